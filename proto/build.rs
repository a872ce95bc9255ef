//! Generates the felixbackend message types, and the CalcServer service when the `grpc` feature
//! is on. A descriptor set is written too so tests can check field numbers against Calico's; with
//! the `json` feature pbjson-build reads it back and writes serde impls (proto3 JSON mapping) to
//! `felix.serde.rs`.
//!
//! Every proto map is a `BTreeMap`, so encoding (binary and JSON) is deterministic: the same
//! message always gives the same bytes and the same JSON line, with map keys in sorted order.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("felixbackend_descriptor.bin");
    println!("cargo:rerun-if-changed=felixbackend.proto");
    tonic_prost_build::configure()
        .build_server(grpc)
        .build_client(grpc)
        .btree_map(".")
        .file_descriptor_set_path(&descriptor_path)
        .compile_protos(&["felixbackend.proto"], &["."])?;

    #[cfg(feature = "json")]
    {
        let descriptor_set = std::fs::read(&descriptor_path)?;
        pbjson_build::Builder::new()
            .register_descriptors(&descriptor_set)?
            .out_dir(&out_dir)
            .btree_map(["."])
            .build(&[".felix"])?;
    }
    Ok(())
}
