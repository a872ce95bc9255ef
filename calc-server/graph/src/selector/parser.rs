//! Recursive-descent parser over the token stream, with Calico's `parser.go` precedence and
//! quirks: `&&` binds tighter than `||`, a run of leading `!`s collapses to one negation (or
//! none), and `in`/`not in` sets are sorted, de-duplicated and may end with a comma.

use super::SyntaxError;
use super::ast::{Node, ValueSet};
use super::tokenizer::{Tok, Token};

/// How deeply parentheses may nest.
///
/// Calico has no limit (Go stacks grow), but a Rust stack overflow aborts the process, and a
/// selector is untrusted datastore content. Real selectors nest a handful of levels.
pub const MAX_NESTING: usize = 256;

/// Parses a whole token stream (ending in `Eof`). No tokens but `Eof` means `all()`.
pub(super) fn parse_tokens(tokens: &[Token<'_>]) -> Result<Node, SyntaxError> {
    let mut parser = Parser {
        tokens,
        next: 0,
        depth: 0,
    };
    if parser.peek().tok == Tok::Eof {
        return Ok(Node::All);
    }
    let node = parser.or_expr()?;
    let rest = parser.peek();
    if rest.tok != Tok::Eof {
        return Err(SyntaxError::new(
            rest.pos,
            format!(
                "unexpected {} after the end of the expression",
                rest.tok.describe()
            ),
        ));
    }
    Ok(node)
}

struct Parser<'t, 'a> {
    tokens: &'t [Token<'a>],
    next: usize,
    depth: usize,
}

impl<'a> Parser<'_, 'a> {
    /// The token `k` places ahead; past the end that is the final `Eof`.
    fn nth(&self, k: usize) -> Token<'a> {
        let last = self.tokens.len() - 1;
        self.tokens[(self.next + k).min(last)]
    }

    fn peek(&self) -> Token<'a> {
        self.nth(0)
    }

    fn advance(&mut self, n: usize) {
        self.next = (self.next + n).min(self.tokens.len() - 1);
    }

    fn or_expr(&mut self) -> Result<Node, SyntaxError> {
        let first = self.and_expr()?;
        if self.peek().tok != Tok::Or {
            return Ok(first);
        }
        let mut operands = vec![first];
        while self.peek().tok == Tok::Or {
            self.advance(1);
            operands.push(self.and_expr()?);
        }
        Ok(Node::Or(operands))
    }

    fn and_expr(&mut self) -> Result<Node, SyntaxError> {
        let first = self.operation()?;
        if self.peek().tok != Tok::And {
            return Ok(first);
        }
        let mut operands = vec![first];
        while self.peek().tok == Tok::And {
            self.advance(1);
            operands.push(self.operation()?);
        }
        Ok(Node::And(operands))
    }

    /// One operation with its leading `!`s.
    fn operation(&mut self) -> Result<Node, SyntaxError> {
        let mut negated = false;
        while self.peek().tok == Tok::Not {
            negated = !negated;
            self.advance(1);
        }
        let token = self.peek();
        let node = match token.tok {
            Tok::Has(label) => {
                self.advance(1);
                Node::Has {
                    label: label.to_owned(),
                }
            }
            Tok::All => {
                self.advance(1);
                Node::All
            }
            Tok::Global => {
                self.advance(1);
                Node::Global
            }
            Tok::Label(label) => self.comparison(label)?,
            Tok::LParen => {
                self.depth += 1;
                if self.depth > MAX_NESTING {
                    return Err(SyntaxError::new(
                        token.pos,
                        format!("parentheses nested more than {MAX_NESTING} deep"),
                    ));
                }
                self.advance(1);
                let inner = self.or_expr()?;
                let close = self.peek();
                if close.tok != Tok::RParen {
                    return Err(SyntaxError::new(
                        close.pos,
                        format!("expected ')', found {}", close.tok.describe()),
                    ));
                }
                self.advance(1);
                self.depth -= 1;
                inner
            }
            other => {
                return Err(SyntaxError::new(
                    token.pos,
                    format!("expected an expression, found {}", other.describe()),
                ));
            }
        };
        Ok(if negated {
            Node::Not(Box::new(node))
        } else {
            node
        })
    }

    /// `label <op> "value"` or `label [not] in {...}`; the cursor is on the label.
    fn comparison(&mut self, label: &str) -> Result<Node, SyntaxError> {
        let op = self.nth(1);
        let operand = self.nth(2);
        let make: fn(String, String) -> Node = match op.tok {
            Tok::Eq => |label, value| Node::Eq { label, value },
            Tok::Ne => |label, value| Node::Ne { label, value },
            Tok::Contains => |label, value| Node::Contains { label, value },
            Tok::StartsWith => |label, value| Node::StartsWith { label, value },
            Tok::EndsWith => |label, value| Node::EndsWith { label, value },
            Tok::In | Tok::NotIn => return self.set_membership(label, op.tok == Tok::In),
            other => {
                return Err(SyntaxError::new(
                    op.pos,
                    format!(
                        "expected an operator after label {label:?}, found {}",
                        other.describe()
                    ),
                ));
            }
        };
        let Tok::Str(value) = operand.tok else {
            return Err(SyntaxError::new(
                operand.pos,
                format!(
                    "expected a quoted string after {}, found {}",
                    op.tok.describe(),
                    operand.tok.describe()
                ),
            ));
        };
        self.advance(3);
        Ok(make(label.to_owned(), value.to_owned()))
    }

    /// `label in {"a", "b",}`; the cursor is on the label.
    fn set_membership(&mut self, label: &str, is_in: bool) -> Result<Node, SyntaxError> {
        let brace = self.nth(2);
        if brace.tok != Tok::LBrace {
            return Err(SyntaxError::new(
                brace.pos,
                format!(
                    "expected '{{' to start a set, found {}",
                    brace.tok.describe()
                ),
            ));
        }
        self.advance(3);
        let mut values = Vec::new();
        let mut after_value = false;
        while let Tok::Str(value) = self.peek().tok {
            values.push(value);
            self.advance(1);
            after_value = true;
            if self.peek().tok != Tok::Comma {
                break;
            }
            self.advance(1);
            after_value = false;
        }
        let close = self.peek();
        if close.tok != Tok::RBrace {
            let expected = if after_value {
                "',' or '}'"
            } else {
                "a quoted string or '}'"
            };
            return Err(SyntaxError::new(
                close.pos,
                format!("expected {expected} in set, found {}", close.tok.describe()),
            ));
        }
        self.advance(1);
        let label = label.to_owned();
        let values = ValueSet::new(values);
        Ok(if is_in {
            Node::In { label, values }
        } else {
            Node::NotIn { label, values }
        })
    }
}
