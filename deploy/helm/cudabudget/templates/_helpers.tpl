{{/* The chart's name, as app.kubernetes.io/name. */}}
{{- define "cudabudget.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release's name, with the chart's unless it
contains it already. */}}
{{- define "cudabudget.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's object name: fullname-component, within 63 characters. */}}
{{- define "cudabudget.componentName" -}}
{{- printf "%s-%s" (include "cudabudget.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{- define "cudabudget.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels a component's pods are selected by (never change on upgrade). */}}
{{- define "cudabudget.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cudabudget.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every object's labels. */}}
{{- define "cudabudget.labels" -}}
helm.sh/chart: {{ include "cudabudget.chart" .root }}
{{ include "cudabudget.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: cudabudget
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The image's tag: image.tag, else the chart's appVersion. */}}
{{- define "cudabudget.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "cudabudget.image" -}}
{{- $repository := required "image.repository: the image built from deploy/docker/Dockerfile" .Values.image.repository }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (include "cudabudget.imageTag" .) }}
{{- end }}
{{- end }}

{{/* The version directory the installer writes and `current` points at. It becomes a
file name on every node: letters, digits, '.', '_' and '-' only. */}}
{{- define "cudabudget.version" -}}
{{- $version := default (include "cudabudget.imageTag" .) .Values.installer.version }}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*$" $version) }}
{{- fail (printf "installer.version %q: use letters, digits, '.', '_' and '-' (it names a directory on each node)" $version) }}
{{- end }}
{{- $version }}
{{- end }}

{{/* An absolute node path without "..", checked once where it is used. */}}
{{- define "cudabudget.nodePath" -}}
{{- if not (regexMatch "^(/[A-Za-z0-9._-]+)+$" .path) }}
{{- fail (printf "%s %q: an absolute path of plain names (letters, digits, '.', '_', '-')" .name .path) }}
{{- end }}
{{- if regexMatch "(^|/)\\.\\.?(/|$)" .path }}
{{- fail (printf "%s %q: no '.' or '..' components" .name .path) }}
{{- end }}
{{- .path }}
{{- end }}

{{/* Scheduling of a node component: its own nodeSelector, tolerations, affinity and
priorityClassName where set, else the chart-wide ones. */}}
{{- define "cudabudget.nodeScheduling" -}}
{{- $values := .root.Values }}
{{- with (default $values.nodeSelector .component.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $values.tolerations .component.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $values.affinity .component.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (default $values.priorityClassName .component.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with $values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Whether the cluster serves a monitoring.coreos.com/v1 kind (or the values force it). */}}
{{- define "cudabudget.hasMonitoringKind" -}}
{{- if or .values.force (.root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" .kind)) }}true{{ end }}
{{- end }}

{{/* A DaemonSet's updateStrategy: rollingUpdate only with type RollingUpdate (the API
refuses it beside OnDelete, and values maps merge with the defaults). */}}
{{- define "cudabudget.updateStrategy" -}}
type: {{ .type }}
{{- if and (eq .type "RollingUpdate") .rollingUpdate }}
rollingUpdate:
  {{- toYaml .rollingUpdate | nindent 2 }}
{{- end }}
{{- end }}
