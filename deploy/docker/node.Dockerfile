# syntax=docker/dockerfile:1
#
# The node services' image: `cudabudget-node` (the Kubernetes device plugin, the admission
# webhook, the exporter) on a small base. The Helm chart's device plugin DaemonSet runs it
# (devicePlugin.image); its webhook and exporter run the same binary from the main image
# (deploy/docker/Dockerfile, /opt/cudabudget/cudabudget-node). Build from the
# repository root:
#
#   docker build -f deploy/docker/node.Dockerfile -t registry.example.com/cudabudget-node:0.1.0 .
#
# The binary loads libnvidia-ml.so.1 at run time: the NVIDIA container runtime mounts it
# (NVIDIA_DRIVER_CAPABILITIES=utility, as the chart sets), nothing of the driver is in
# the image.

# The Rust toolchain the project pins (Cargo.toml: rust-version = 1.95).
ARG RUST_IMAGE=rust:1.95-bookworm
ARG BASE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# The .proto is compiled by protox (Rust) in the build script: no protoc needed.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p cudabudget-node \
 && install -D -m 0755 target/release/cudabudget-node /out/cudabudget-node

FROM ${BASE}
COPY --from=build /out/cudabudget-node /usr/local/bin/cudabudget-node
ENTRYPOINT ["/usr/local/bin/cudabudget-node"]
CMD ["device-plugin"]
