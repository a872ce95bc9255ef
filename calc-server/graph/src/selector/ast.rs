//! The selector syntax tree: evaluation against labels and Calico's canonical rendering.
//!
//! The rendering here is what `Selector::canonical()` returns and what the unique id hashes,
//! so it must stay byte-for-byte identical to Calico's `Selector.String()`.

use super::Labels;

/// One node of a parsed selector.
///
/// The parser only produces `And`/`Or` with two or more operands, and never wraps the
/// operand of a bare `!` in anything but the operation it negates. Trees built by hand go
/// through [`Selector::from_node`](super::Selector::from_node), which fixes up degenerate
/// `And`/`Or` nodes so that the canonical string always re-parses.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Node {
    /// `label == "value"`: the label is present and equal to `value`.
    Eq { label: String, value: String },
    /// `label != "value"`: the label is absent, or present with another value.
    Ne { label: String, value: String },
    /// `label contains "value"`: present and `value` is a substring.
    Contains { label: String, value: String },
    /// `label starts with "value"`: present and `value` is a prefix.
    StartsWith { label: String, value: String },
    /// `label ends with "value"`: present and `value` is a suffix.
    EndsWith { label: String, value: String },
    /// `label in {...}`: present and its value is in the set (so `in {}` never matches).
    In { label: String, values: ValueSet },
    /// `label not in {...}`: absent, or present with a value outside the set.
    NotIn { label: String, values: ValueSet },
    /// `has(label)`: present, whatever the value (including `""`).
    Has { label: String },
    /// `all()`: always true.
    All,
    /// `global()`: always true here; it only means something to rule translation.
    Global,
    /// `!operand`.
    Not(Box<Node>),
    /// `(a && b && ...)`.
    And(Vec<Node>),
    /// `(a || b || ...)`.
    Or(Vec<Node>),
}

/// The right-hand side of `in`/`not in`: sorted by bytes and free of duplicates.
///
/// Keeping the invariant in a type lets evaluation use a binary search without trusting
/// whoever built the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ValueSet(Vec<String>);

impl ValueSet {
    /// Builds a set from any values, sorting and de-duplicating them as Calico does.
    pub fn new<I, S>(values: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut values: Vec<String> = values.into_iter().map(Into::into).collect();
        values.sort_unstable();
        values.dedup();
        ValueSet(values)
    }

    /// Whether `value` is a member.
    pub fn contains(&self, value: &str) -> bool {
        self.0.binary_search_by(|v| v.as_str().cmp(value)).is_ok()
    }

    /// The members in canonical (byte) order.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<S: Into<String>> FromIterator<S> for ValueSet {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        ValueSet::new(iter)
    }
}

impl Node {
    /// Evaluates the node against a label set. Does not allocate.
    pub fn evaluate<L: Labels + ?Sized>(&self, labels: &L) -> bool {
        match self {
            Node::Eq { label, value } => labels.get_label(label) == Some(value.as_str()),
            Node::Ne { label, value } => labels.get_label(label) != Some(value.as_str()),
            Node::Contains { label, value } => labels
                .get_label(label)
                .is_some_and(|v| v.contains(value.as_str())),
            Node::StartsWith { label, value } => labels
                .get_label(label)
                .is_some_and(|v| v.starts_with(value.as_str())),
            Node::EndsWith { label, value } => labels
                .get_label(label)
                .is_some_and(|v| v.ends_with(value.as_str())),
            Node::In { label, values } => {
                labels.get_label(label).is_some_and(|v| values.contains(v))
            }
            Node::NotIn { label, values } => {
                !labels.get_label(label).is_some_and(|v| values.contains(v))
            }
            Node::Has { label } => labels.get_label(label).is_some(),
            Node::All | Node::Global => true,
            Node::Not(operand) => !operand.evaluate(labels),
            Node::And(operands) => operands.iter().all(|n| n.evaluate(labels)),
            Node::Or(operands) => operands.iter().any(|n| n.evaluate(labels)),
        }
    }

    /// The label this node tests, if it is a leaf that tests one.
    pub fn label(&self) -> Option<&str> {
        match self {
            Node::Eq { label, .. }
            | Node::Ne { label, .. }
            | Node::Contains { label, .. }
            | Node::StartsWith { label, .. }
            | Node::EndsWith { label, .. }
            | Node::In { label, .. }
            | Node::NotIn { label, .. }
            | Node::Has { label } => Some(label),
            Node::All | Node::Global | Node::Not(_) | Node::And(_) | Node::Or(_) => None,
        }
    }

    fn label_mut(&mut self) -> Option<&mut String> {
        match self {
            Node::Eq { label, .. }
            | Node::Ne { label, .. }
            | Node::Contains { label, .. }
            | Node::StartsWith { label, .. }
            | Node::EndsWith { label, .. }
            | Node::In { label, .. }
            | Node::NotIn { label, .. }
            | Node::Has { label } => Some(label),
            Node::All | Node::Global | Node::Not(_) | Node::And(_) | Node::Or(_) => None,
        }
    }

    /// Calls `f` with every label name the tree mentions, in rendering order (repeats included).
    pub fn for_each_label<'a>(&'a self, f: &mut impl FnMut(&'a str)) {
        match self {
            Node::Not(operand) => operand.for_each_label(f),
            Node::And(operands) | Node::Or(operands) => {
                operands.iter().for_each(|n| n.for_each_label(f));
            }
            leaf => {
                if let Some(label) = leaf.label() {
                    f(label);
                }
            }
        }
    }

    /// Prepends `prefix` to every label name (Calico's `PrefixVisitor`).
    pub(super) fn prefix_labels(&mut self, prefix: &str) {
        match self {
            Node::Not(operand) => operand.prefix_labels(prefix),
            Node::And(operands) | Node::Or(operands) => {
                operands.iter_mut().for_each(|n| n.prefix_labels(prefix));
            }
            leaf => {
                if let Some(label) = leaf.label_mut() {
                    label.insert_str(0, prefix);
                }
            }
        }
    }

    /// Replaces `And`/`Or` nodes with fewer than two operands by something equivalent.
    ///
    /// Calico renders a one-operand AND as `(x)`, which re-parses as plain `x` under a
    /// different id, and cannot render an empty one at all; hand-built trees must not
    /// produce either.
    pub(super) fn fix_degenerate(self) -> Node {
        match self {
            Node::Not(operand) => Node::Not(Box::new(operand.fix_degenerate())),
            Node::And(operands) => {
                let mut operands: Vec<Node> =
                    operands.into_iter().map(Node::fix_degenerate).collect();
                match operands.len() {
                    0 => Node::All,
                    1 => operands.pop().unwrap_or(Node::All),
                    _ => Node::And(operands),
                }
            }
            Node::Or(operands) => {
                let mut operands: Vec<Node> =
                    operands.into_iter().map(Node::fix_degenerate).collect();
                match operands.len() {
                    // An empty OR matches nothing; `!all()` is Calico's own spelling of that.
                    0 => Node::Not(Box::new(Node::All)),
                    1 => operands.pop().unwrap_or(Node::All),
                    _ => Node::Or(operands),
                }
            }
            leaf => leaf,
        }
    }

    /// Appends Calico's canonical rendering of this node to `out`.
    pub fn write_canonical(&self, out: &mut String) {
        match self {
            Node::Eq { label, value } => write_comparison(out, label, " == ", value),
            Node::Ne { label, value } => write_comparison(out, label, " != ", value),
            Node::Contains { label, value } => write_comparison(out, label, " contains ", value),
            Node::StartsWith { label, value } => {
                write_comparison(out, label, " starts with ", value);
            }
            Node::EndsWith { label, value } => write_comparison(out, label, " ends with ", value),
            Node::In { label, values } => write_set(out, label, " in {", values),
            Node::NotIn { label, values } => write_set(out, label, " not in {", values),
            Node::Has { label } => {
                out.push_str("has(");
                out.push_str(label);
                out.push(')');
            }
            Node::All => out.push_str("all()"),
            Node::Global => out.push_str("global()"),
            Node::Not(operand) => {
                // No parentheses: the operand supplies its own if it is an AND/OR. This is
                // why `!(!has(a))` renders as `!!has(a)`, which re-parses as `has(a)`.
                out.push('!');
                operand.write_canonical(out);
            }
            Node::And(operands) => write_joined(out, operands, " && "),
            Node::Or(operands) => write_joined(out, operands, " || "),
        }
    }

    /// The canonical rendering as a new string.
    pub fn to_canonical(&self) -> String {
        let mut out = String::new();
        self.write_canonical(&mut out);
        out
    }
}

fn write_joined(out: &mut String, operands: &[Node], separator: &str) {
    out.push('(');
    for (i, operand) in operands.iter().enumerate() {
        if i > 0 {
            out.push_str(separator);
        }
        operand.write_canonical(out);
    }
    out.push(')');
}

fn write_comparison(out: &mut String, label: &str, op: &str, value: &str) {
    out.push_str(label);
    out.push_str(op);
    write_quoted(out, value);
}

fn write_set(out: &mut String, label: &str, op_and_brace: &str, values: &ValueSet) {
    out.push_str(label);
    out.push_str(op_and_brace);
    for (i, value) in values.as_slice().iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_quoted(out, value);
    }
    out.push('}');
}

/// Literals have no escapes, so the only way to keep a `"` is to single-quote the value.
fn write_quoted(out: &mut String, value: &str) {
    let quote = if value.contains('"') { '\'' } else { '"' };
    out.push(quote);
    out.push_str(value);
    out.push(quote);
}
