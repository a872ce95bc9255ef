//! dataplane-agent: follows a calc-server's `CalcServer.Sync` stream and programs this node's
//! dataplane through a pluggable [`driver::Driver`].
//!
//! * [`session`] — the stream: hello, snapshot, `InSync`, deltas, reports back, reconnects with
//!   back-off and fail-over, mark and sweep across reconnects.
//! * [`message`] — the typed boundary: each `ToDataplane` converted once into a [`message::Message`]
//!   with typed keys, or refused as [`message::InvalidMessage`].
//! * [`driver`] — the driver trait and the drivers (`dry-run`, `linux`).
//! * [`flows`] — flow logs: NFLOG events and conntrack aggregated per connection and interval.
//! * [`cli`] — the command line (with [`config_file`] beneath flags and environment).
//! * [`tls`] — mutual TLS to the calc-server; [`admin`] — health and metrics.
//!
//! `docs/proto.md` is the stream contract; `docs/drivers.md` is the driver contract.

pub mod admin;
pub mod cli;
pub mod driver;
pub mod flows;
pub mod message;
pub mod session;
pub mod tls;
pub mod tracker;
