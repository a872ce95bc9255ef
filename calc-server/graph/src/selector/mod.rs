//! Calico's label-selector language (`libcalico-go/lib/selector`), reproduced exactly.
//!
//! Contract: [`parse`] accepts precisely the selectors Calico's `Parse` accepts (no trimming,
//! only spaces and tabs are whitespace, an empty selector is `all()`), [`Selector::canonical`]
//! is byte-for-byte Calico's `Selector.String()`, and [`Selector::unique_id`] is its
//! `UniqueID()`. Those strings name IP sets and chains in the dataplane, so any drift from
//! Calico shows up as churn or mismatched state. [`Selector::evaluate`] never allocates.
//!
//! The one deliberate difference: parentheses may nest at most [`MAX_NESTING`] deep, because
//! unbounded recursion on untrusted input would overflow the stack.

mod ast;
mod parser;
mod tokenizer;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher};
use std::str::FromStr;
use std::sync::{Arc, LazyLock};

pub use ast::{Node, ValueSet};
pub use parser::MAX_NESTING;
pub use tokenizer::{MAX_LABEL_LEN, is_label_byte};

use crate::hash::make_unique_id;

/// Whether `name` can be written as a label in a selector (Calico's `tokenizer.ValidLabel`):
/// 1 to 512 bytes of `[a-zA-Z0-9_./-]`.
pub fn is_valid_label(name: &str) -> bool {
    (1..=MAX_LABEL_LEN).contains(&name.len()) && name.bytes().all(is_label_byte)
}

/// Something a selector can be evaluated against: a flat map from label name to value.
pub trait Labels {
    /// The value of label `key`, or `None` if it is absent (`Some("")` is present).
    fn get_label(&self, key: &str) -> Option<&str>;
}

impl Labels for BTreeMap<String, String> {
    fn get_label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl<S: BuildHasher> Labels for HashMap<String, String, S> {
    fn get_label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

impl<L: Labels + ?Sized> Labels for &L {
    fn get_label(&self, key: &str) -> Option<&str> {
        (**self).get_label(key)
    }
}

/// Why a selector did not parse, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} at byte {position} of selector {input:?}")]
pub struct ParseError {
    /// The selector exactly as given to [`parse`].
    pub input: String,
    /// Byte offset into `input` where parsing failed (`input.len()` if it ended too early).
    pub position: usize,
    pub message: String,
}

/// A position-tagged error from the tokenizer or parser, before the input is attached.
#[derive(Debug)]
struct SyntaxError {
    position: usize,
    message: String,
}

impl SyntaxError {
    fn new(position: usize, message: impl Into<String>) -> Self {
        SyntaxError {
            position,
            message: message.into(),
        }
    }
}

/// A parsed selector with its canonical string and unique id computed once.
///
/// Cloning is cheap (shared). Equality, ordering and hashing go by the canonical string, as
/// Calico keys selectors by it.
#[derive(Clone)]
pub struct Selector {
    inner: Arc<Inner>,
}

struct Inner {
    root: Node,
    canonical: String,
    unique_id: String,
}

/// Parses a selector as Calico's `Parse` does.
///
/// Nothing is trimmed: leading/trailing spaces and tabs are fine, but a newline or any other
/// character outside a string literal is an error. An empty or blank selector is `all()`.
pub fn parse(input: &str) -> Result<Selector, ParseError> {
    let located = |e: SyntaxError| ParseError {
        input: input.to_owned(),
        position: e.position,
        message: e.message,
    };
    let tokens = tokenizer::tokenize(input).map_err(located)?;
    let root = parser::parse_tokens(&tokens).map_err(located)?;
    Ok(Selector::build(root))
}

/// Checks a selector's syntax (Calico's `Validate`).
pub fn validate(input: &str) -> Result<(), ParseError> {
    parse(input).map(drop)
}

/// Calico's `selector.Normalise`: trims surrounding whitespace, then returns the canonical
/// string. If the trimmed selector does not parse, it is returned as it is.
///
/// Note that Calico trims any Unicode whitespace here (Go's `strings.TrimSpace`), so a
/// trailing newline is accepted by `normalise` but not by [`parse`].
pub fn normalise(input: &str) -> String {
    let trimmed = input.trim();
    match parse(trimmed) {
        Ok(selector) => selector.canonical().to_owned(),
        Err(_) => trimmed.to_owned(),
    }
}

/// The conjunction of `parts`: the same selector Calico gets by parsing
/// `"(p1) && (p2) && ..."`. No parts gives `all()`; one part gives that part.
pub fn and(parts: Vec<Selector>) -> Selector {
    Selector::from_node(Node::And(parts.iter().map(|s| s.root().clone()).collect()))
}

/// The disjunction of `parts`: the same selector Calico gets by parsing
/// `"(p1) || (p2) || ..."`. No parts gives `!all()` (matches nothing); one gives that part.
pub fn or(parts: Vec<Selector>) -> Selector {
    Selector::from_node(Node::Or(parts.iter().map(|s| s.root().clone()).collect()))
}

static ALL: LazyLock<Selector> = LazyLock::new(|| Selector::build(Node::All));

impl Selector {
    /// `all()`, which matches everything.
    pub fn all() -> Selector {
        ALL.clone()
    }

    /// Wraps a hand-built tree, computing its canonical string and id.
    ///
    /// `And`/`Or` nodes with fewer than two operands are replaced by their equivalent (see
    /// [`and`]/[`or`]) because Calico cannot render them faithfully. Label names and values
    /// are taken as given: a label outside `[a-zA-Z0-9_./-]`, or a value holding both quote
    /// characters, renders to a string that will not re-parse, as in Calico.
    pub fn from_node(root: Node) -> Selector {
        Selector::build(root.fix_degenerate())
    }

    fn build(root: Node) -> Selector {
        let canonical = root.to_canonical();
        let unique_id = make_unique_id("s", &canonical);
        Selector {
            inner: Arc::new(Inner {
                root,
                canonical,
                unique_id,
            }),
        }
    }

    /// Whether the labels match. Never allocates.
    pub fn evaluate<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        self.inner.root.evaluate(labels)
    }

    /// Calico's `Selector.String()`.
    pub fn canonical(&self) -> &str {
        &self.inner.canonical
    }

    /// Calico's `Selector.UniqueID()`: `"s:"` + base64url(SHA-224(`"s:"` + canonical)).
    pub fn unique_id(&self) -> &str {
        &self.inner.unique_id
    }

    /// A copy with `prefix` prepended to every label name (Calico's `PrefixVisitor`, which is
    /// how namespace and service-account selectors get their `pcns.`/`pcsa.` prefixes).
    pub fn with_label_prefix(&self, prefix: &str) -> Selector {
        if prefix.is_empty() {
            return self.clone();
        }
        let mut root = self.inner.root.clone();
        root.prefix_labels(prefix);
        Selector::build(root)
    }

    /// Whether this is exactly `all()` (by canonical string, as Calico compares).
    pub fn is_all(&self) -> bool {
        self.canonical() == "all()"
    }

    /// The syntax tree.
    pub fn root(&self) -> &Node {
        &self.inner.root
    }
}

impl Default for Selector {
    fn default() -> Self {
        Selector::all()
    }
}

impl FromStr for Selector {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.canonical())
    }
}

impl fmt::Debug for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Selector").field(&self.canonical()).finish()
    }
}

impl PartialEq for Selector {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner) || self.canonical() == other.canonical()
    }
}

impl Eq for Selector {}

impl PartialOrd for Selector {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Selector {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.canonical().cmp(other.canonical())
    }
}

impl Hash for Selector {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.canonical().hash(state);
    }
}
