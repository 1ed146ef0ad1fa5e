//! Compiles `proto/deviceplugin_v1beta1.proto` (the kubelet's device plugin API) with
//! protox, a protobuf compiler in Rust, and generates tonic's client and server from it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/deviceplugin_v1beta1.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
