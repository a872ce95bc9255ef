//! The desired state: what the managers want in the kernel, in no writer's syntax.
//!
//! Managers write chains (with the stream object each renders) and hook rules into
//! [`Tables`], and IP sets with their members into [`Sets`]; the kernel writer chosen at start
//! reads them, renders them in its own syntax and diffs them against its own view of the
//! kernel. Contract: nothing here does IO or knows a writer. Each store keeps a change log
//! (chains and sets set or removed since the writer last took it) so a writer's work follows
//! the size of a change, not of the ruleset; exactly one writer takes it.

pub(crate) mod chains;
pub(crate) mod sets;

pub(crate) use self::chains::{TABLE_NAMES, Table, TableChanges, Tables};
pub(crate) use self::sets::{SetChanges, SetKind, Sets};
