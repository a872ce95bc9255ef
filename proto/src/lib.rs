//! Calico's felixbackend protobuf messages and our `CalcServer.Sync` service.
//!
//! Message names, field names and field numbers are Calico's (`felix/proto/felixbackend.proto`),
//! so anything built from Calico's proto decodes our bytes. Our additions use new messages or
//! field numbers Calico does not use; see `docs/proto.md`.

#![allow(clippy::large_enum_variant, clippy::doc_lazy_continuation)]

/// Generated types, package `felix`.
///
/// With the `json` feature every message and enum also implements `serde::Serialize` and
/// `serde::Deserialize` in the proto3 canonical JSON mapping (pbjson): lowerCamelCase field
/// names, enums as their names, 64-bit integers as strings, default values omitted, a oneof as
/// its set member's field. Deserialising accepts the original proto field names as well.
pub mod felix {
    include!(concat!(env!("OUT_DIR"), "/felix.rs"));
    #[cfg(feature = "json")]
    include!(concat!(env!("OUT_DIR"), "/felix.serde.rs"));
}

pub use felix::*;

/// Goldmane's flow API (package `goldmane`, `goldmane.proto`): Calico's flow aggregator's
/// messages, names and numbers, and its `Flows`, `FlowCollector` and `Statistics` services with
/// the `grpc` feature. Not served yet; see `docs/proto.md`.
///
/// With the `json` feature: serde in the proto3 JSON mapping, except that field names are kept as
/// written in the schema (`start_time`, `enforced_policies`, `Key`), which is what Goldmane's own
/// JSON (its Go types' tags) uses. Deserialising accepts the lowerCamelCase names too.
pub mod goldmane {
    include!(concat!(env!("OUT_DIR"), "/goldmane.rs"));
    #[cfg(feature = "json")]
    include!(concat!(env!("OUT_DIR"), "/goldmane.serde.rs"));

    /// The encoded `FileDescriptorSet` of `goldmane.proto`, for reflection and tests.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/goldmane_descriptor.bin"));
}

pub mod encoded;
#[cfg(feature = "grpc")]
pub mod framed;

/// The prost version the messages are generated with (for `Message::encoded_len` and friends).
pub use prost;

/// The encoded `FileDescriptorSet` of `felixbackend.proto`, for reflection and tests.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/felixbackend_descriptor.bin"));
