//! A `ToDataplane` encoded once, without its sequence number: the form in which a message
//! shared by many nodes' streams is sent (see `framed`), and in which the calculation graph
//! may hold a large message it keeps between flushes. Needs neither tonic nor a runtime.

use prost::Message;
use prost::bytes::Bytes;

use crate::ToDataplane;

/// A `ToDataplane` without its sequence number, encoded once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Encoded(Bytes);

impl Encoded {
    /// Encodes `msg`, leaving its sequence number out.
    pub fn new(msg: &ToDataplane) -> Encoded {
        let mut buf = Vec::with_capacity(prost::Message::encoded_len(msg));
        if let Some(payload) = &msg.payload {
            payload.encode(&mut buf);
        }
        Encoded(Bytes::from(buf))
    }

    /// The encoded length without a sequence number (what the stream's backlog is sized by).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The encoded bytes (shared, not copied, between the frames that send them).
    pub fn as_slice(&self) -> &[u8] {
        &self.0
    }

    /// The encoded bytes as a shared handle (no copy).
    pub fn to_bytes(&self) -> Bytes {
        self.0.clone()
    }

    /// The message these bytes stand for, its sequence number 0.
    pub fn decode(&self) -> Result<ToDataplane, prost::DecodeError> {
        ToDataplane::decode(self.as_slice())
    }
}
