//! Generates the felixbackend message types, and the CalcServer service when the `grpc` feature
//! is on. A descriptor set is written too so tests can check field numbers against Calico's.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed=felixbackend.proto");
    tonic_prost_build::configure()
        .build_server(grpc)
        .build_client(grpc)
        .file_descriptor_set_path(out_dir.join("felixbackend_descriptor.bin"))
        .compile_protos(&["felixbackend.proto"], &["."])?;
    Ok(())
}
