# The gpuslice image: the `gpuslice` binary (operator, agent, run) and the shim next to it, where
# `gpuslice run` looks for it, built without the developer feature (no emulators, benchmarks or
# demo in the product). Build: docker build -t <registry>/gpuslice:<tag> .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --no-default-features -p gpuslice -p gpuslice-shim \
 && mkdir -p /out \
 && cp target/release/gpuslice target/release/libgpuslice.so /out/

FROM debian:bookworm-slim
# CA certificates for the Git source (https; OpenSSL and libgit2 are built into the binary); NVML
# comes from the host through the NVIDIA container runtime.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/gpuslice /out/libgpuslice.so /usr/local/bin/
# The operator runs as this user (the chart sets it too); the agent's pod runs as root, privileged.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpuslice"]
