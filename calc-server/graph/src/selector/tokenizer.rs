//! Splits a selector into tokens, following Calico's `tokenizer.AppendTokens` rule for rule.
//!
//! The rules that are easy to get wrong: only `' '` and `'\t'` are whitespace; word
//! operators are recognised only straight after a label (so keywords are never reserved);
//! an operator keyword must end at a word boundary but the next token need not start at one.

use super::SyntaxError;

/// Calico's limit on the length of a label name, in bytes.
pub const MAX_LABEL_LEN: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tok<'a> {
    Label(&'a str),
    Str(&'a str),
    LBrace,
    RBrace,
    Comma,
    Eq,
    Ne,
    In,
    Not,
    NotIn,
    Contains,
    StartsWith,
    EndsWith,
    All,
    Has(&'a str),
    LParen,
    RParen,
    And,
    Or,
    Global,
    Eof,
}

impl Tok<'_> {
    /// How the token reads in an error message.
    pub(super) fn describe(&self) -> String {
        let text = match self {
            Tok::Label(l) => return format!("label {l:?}"),
            Tok::Str(s) => return format!("string {s:?}"),
            Tok::Has(l) => return format!("'has({l})'"),
            Tok::LBrace => "'{'",
            Tok::RBrace => "'}'",
            Tok::Comma => "','",
            Tok::Eq => "'=='",
            Tok::Ne => "'!='",
            Tok::In => "'in'",
            Tok::Not => "'!'",
            Tok::NotIn => "'not in'",
            Tok::Contains => "'contains'",
            Tok::StartsWith => "'starts with'",
            Tok::EndsWith => "'ends with'",
            Tok::All => "'all()'",
            Tok::LParen => "'('",
            Tok::RParen => "')'",
            Tok::And => "'&&'",
            Tok::Or => "'||'",
            Tok::Global => "'global()'",
            Tok::Eof => "end of selector",
        };
        text.to_owned()
    }
}

/// A token and the byte offset where it starts (the input length for `Eof`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Token<'a> {
    pub tok: Tok<'a>,
    pub pos: usize,
}

/// Whether `b` may appear in a label name: `[a-zA-Z0-9_./-]`.
pub fn is_label_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-')
}

/// Tokenizes `input`; on success the last token is always `Eof`.
pub(super) fn tokenize(input: &str) -> Result<Vec<Token<'_>>, SyntaxError> {
    let mut lexer = Lexer {
        input,
        bytes: input.as_bytes(),
        pos: 0,
        tokens: Vec::with_capacity(input.len() / 3 + 2),
    };
    lexer.run()?;
    Ok(lexer.tokens)
}

struct Lexer<'a> {
    input: &'a str,
    bytes: &'a [u8],
    /// Always on a char boundary: it only ever steps over ASCII bytes or whole literals.
    pos: usize,
    tokens: Vec<Token<'a>>,
}

impl<'a> Lexer<'a> {
    fn run(&mut self) -> Result<(), SyntaxError> {
        loop {
            self.pos = self.skip_whitespace(self.pos);
            let start = self.pos;
            let Some(&byte) = self.bytes.get(start) else {
                self.tokens.push(Token {
                    tok: Tok::Eof,
                    pos: start,
                });
                return Ok(());
            };
            let tok = match byte {
                b'(' => self.single(Tok::LParen),
                b')' => self.single(Tok::RParen),
                b'{' => self.single(Tok::LBrace),
                b'}' => self.single(Tok::RBrace),
                b',' => self.single(Tok::Comma),
                b'"' | b'\'' => self.string_literal(byte)?,
                b'=' => self.double(
                    b'=',
                    Tok::Eq,
                    "expected '==' (a single '=' is not an operator)",
                )?,
                b'&' => self.double(b'&', Tok::And, "expected '&&'")?,
                b'|' => self.double(b'|', Tok::Or, "expected '||'")?,
                b'!' => {
                    if self.bytes.get(start + 1) == Some(&b'=') {
                        self.pos += 2;
                        Tok::Ne
                    } else {
                        self.single(Tok::Not)
                    }
                }
                _ => match self.tokens.last() {
                    Some(Token {
                        tok: Tok::Label(label),
                        ..
                    }) => {
                        let label = *label;
                        self.operator(label)?
                    }
                    _ => self.word()?,
                },
            };
            self.tokens.push(Token { tok, pos: start });
        }
    }

    fn single(&mut self, tok: Tok<'a>) -> Tok<'a> {
        self.pos += 1;
        tok
    }

    fn double(&mut self, second: u8, tok: Tok<'a>, message: &str) -> Result<Tok<'a>, SyntaxError> {
        if self.bytes.get(self.pos + 1) == Some(&second) {
            self.pos += 2;
            Ok(tok)
        } else {
            Err(SyntaxError::new(self.pos, message))
        }
    }

    /// A literal runs to the next identical quote; there are no escapes.
    fn string_literal(&mut self, quote: u8) -> Result<Tok<'a>, SyntaxError> {
        let body_start = self.pos + 1;
        let Some(len) = self.bytes[body_start..].iter().position(|&b| b == quote) else {
            return Err(SyntaxError::new(self.pos, "unterminated string literal"));
        };
        let body_end = body_start + len;
        self.pos = body_end + 1;
        Ok(Tok::Str(&self.input[body_start..body_end]))
    }

    /// The operator that must follow a label. Multi-word operators accept any run of
    /// spaces and tabs between the words, including none (`startswith`, `notin`).
    fn operator(&mut self, label: &str) -> Result<Tok<'a>, SyntaxError> {
        let candidates: [(&[&str], Tok<'a>); 5] = [
            (&["contains"], Tok::Contains),
            (&["starts", "with"], Tok::StartsWith),
            (&["ends", "with"], Tok::EndsWith),
            (&["not", "in"], Tok::NotIn),
            (&["in"], Tok::In),
        ];
        for (words, tok) in candidates {
            if let Some(end) = self.match_words(words) {
                self.pos = end;
                return Ok(tok);
            }
        }
        Err(SyntaxError::new(
            self.pos,
            format!("expected an operator after label {label:?}"),
        ))
    }

    /// Matches `words` at the cursor and returns where the operator ends.
    fn match_words(&self, words: &[&str]) -> Option<usize> {
        let mut at = self.pos;
        for word in words {
            if !self.bytes[at..].starts_with(word.as_bytes()) {
                return None;
            }
            at += word.len();
            // Calico skips whitespace after every word of a multi-word operator (the last
            // one included) before its boundary check, but not after a one-word operator.
            // Only error messages can tell the difference; it is mirrored anyway.
            if words.len() > 1 {
                at = self.skip_whitespace(at);
            }
        }
        let at_boundary = self.bytes.get(at).is_none_or(|&b| !is_label_byte(b));
        at_boundary.then_some(at)
    }

    /// `has(label)`, `all()`, `global()` or a bare label.
    fn word(&mut self) -> Result<Tok<'a>, SyntaxError> {
        let rest = &self.bytes[self.pos..];
        if rest.starts_with(b"has(") {
            let open = self.pos + 3;
            let label_start = self.skip_whitespace(open + 1);
            let (label, label_end) = self.label_at(label_start)?;
            let close = self.skip_whitespace(label_end);
            self.pos = self.expect_close(close, "has(")?;
            Ok(Tok::Has(label))
        } else if rest.starts_with(b"all(") {
            let close = self.skip_whitespace(self.pos + 4);
            self.pos = self.expect_close(close, "all(")?;
            Ok(Tok::All)
        } else if rest.starts_with(b"global(") {
            let close = self.skip_whitespace(self.pos + 7);
            self.pos = self.expect_close(close, "global(")?;
            Ok(Tok::Global)
        } else {
            let (label, end) = self.label_at(self.pos)?;
            self.pos = end;
            Ok(Tok::Label(label))
        }
    }

    fn expect_close(&self, at: usize, opener: &str) -> Result<usize, SyntaxError> {
        if self.bytes.get(at) == Some(&b')') {
            Ok(at + 1)
        } else {
            Err(SyntaxError::new(
                at,
                format!("expected ')' to close '{opener}'"),
            ))
        }
    }

    /// The longest run of label bytes at `start`, which must be 1 to 512 bytes long.
    fn label_at(&self, start: usize) -> Result<(&'a str, usize), SyntaxError> {
        let len = self.bytes[start..]
            .iter()
            .position(|&b| !is_label_byte(b))
            .unwrap_or(self.bytes.len() - start);
        if len == 0 {
            let message = match self.input[start..].chars().next() {
                Some(c) => format!("expected a label name, found {c:?}"),
                None => "expected a label name, found end of selector".to_owned(),
            };
            return Err(SyntaxError::new(start, message));
        }
        if len > MAX_LABEL_LEN {
            return Err(SyntaxError::new(
                start,
                format!("label is {len} bytes long; the limit is {MAX_LABEL_LEN}"),
            ));
        }
        let end = start + len;
        Ok((&self.input[start..end], end))
    }

    fn skip_whitespace(&self, mut at: usize) -> usize {
        while matches!(self.bytes.get(at), Some(b' ' | b'\t')) {
            at += 1;
        }
        at
    }
}
