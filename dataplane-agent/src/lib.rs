//! dataplane-agent: follows a calc-server's `CalcServer.Sync` stream and programs this node's
//! dataplane through a pluggable [`driver::Driver`].
//!
//! * [`session`] — the stream: hello, snapshot, `InSync`, deltas, reports back, reconnects with
//!   back-off and fail-over, mark and sweep across reconnects.
//! * [`driver`] — the driver trait and the drivers (`dry-run`; `linux` is not implemented yet).
//! * [`cli`] — the command line.
//!
//! `docs/proto.md` is the stream contract; `docs/drivers.md` is the driver contract.

pub mod backoff;
pub mod cli;
pub mod clock;
pub mod driver;
pub mod session;
pub mod tracker;
