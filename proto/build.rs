//! Generates the felixbackend message types, and the CalcServer service when the `grpc` feature
//! is on; likewise Goldmane's flow API (`goldmane.proto`: messages, and the Flows, FlowCollector
//! and Statistics services with `grpc`), with a descriptor set and serde impls of its own. A descriptor set is written too so tests can check field numbers against Calico's; with
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

    let goldmane_descriptor_path = out_dir.join("goldmane_descriptor.bin");
    println!("cargo:rerun-if-changed=goldmane.proto");
    // FlowCollector's rpc is named Connect: the generated client's `connect` constructor would
    // clash with it, so Goldmane's clients have only `new(channel)`.
    tonic_prost_build::configure()
        .build_server(grpc)
        .build_client(grpc)
        .build_transport(false)
        .btree_map(".")
        .file_descriptor_set_path(&goldmane_descriptor_path)
        .compile_protos(&["goldmane.proto"], &["."])?;

    #[cfg(feature = "json")]
    {
        let descriptor_set = std::fs::read(&descriptor_path)?;
        pbjson_build::Builder::new()
            .register_descriptors(&descriptor_set)?
            .out_dir(&out_dir)
            .btree_map(["."])
            .build(&[".felix"])?;
        // Goldmane's JSON keeps the proto field names (`start_time`, `enforced_policies`,
        // `Key`), as its Go types' JSON tags do; enums are their names, as in protojson.
        let goldmane_descriptor_set = std::fs::read(&goldmane_descriptor_path)?;
        pbjson_build::Builder::new()
            .register_descriptors(&goldmane_descriptor_set)?
            .out_dir(&out_dir)
            .btree_map(["."])
            .preserve_proto_field_names()
            .build(&[".goldmane"])?;
    }
    Ok(())
}
