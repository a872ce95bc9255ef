//! [`SharedMessage`]: one `ToDataplane` handed to every node whose batch carries it.
//!
//! Contract: a shared message is immutable, cheap to clone (a reference count) and compares by
//! content. Most are held as the protobuf message. A whole IP set is held as its encoding
//! instead (about 14 bytes per member, where the message spends a 24-byte `String` and its
//! allocation on each): it is the largest thing a flush builds, kept between flushes while
//! agents keep connecting, and what a server does with it is send those very bytes. Reading it
//! as a message ([`std::ops::Deref`]) decodes it once and keeps the result, which only tests,
//! offline tools and views do; the serving path uses [`SharedMessage::encoded`] and
//! [`SharedMessage::ipset_id`], which never decode.

use std::sync::{Arc, OnceLock};

use felix_proto as pb;
use felix_proto::encoded::Encoded;

use super::Name;

/// A message shared by every node that receives it in one flush (encode once, send many).
#[derive(Clone)]
pub struct SharedMessage(Arc<Held>);

enum Held {
    Message(pb::ToDataplane),
    /// A whole IP set, held encoded: its id (to key caches without decoding) and its bytes.
    Encoded {
        ipset_id: Name,
        bytes: Encoded,
        decoded: OnceLock<pb::ToDataplane>,
    },
}

impl SharedMessage {
    pub fn new(message: pb::ToDataplane) -> SharedMessage {
        SharedMessage(Arc::new(Held::Message(message)))
    }

    /// A whole IP set `message` (an `IpsetUpdate` with every member), kept only encoded.
    pub(super) fn whole_ipset(ipset_id: Name, message: &pb::ToDataplane) -> SharedMessage {
        SharedMessage(Arc::new(Held::Encoded {
            ipset_id,
            bytes: Encoded::new(message),
            decoded: OnceLock::new(),
        }))
    }

    /// The encoding, when the message is held encoded (shared, not copied, by clones).
    pub fn encoded(&self) -> Option<&Encoded> {
        match &*self.0 {
            Held::Encoded { bytes, .. } => Some(bytes),
            Held::Message(_) => None,
        }
    }

    /// The message, when it is held as one (no decoding).
    pub fn held_message(&self) -> Option<&pb::ToDataplane> {
        match &*self.0 {
            Held::Message(m) => Some(m),
            Held::Encoded { .. } => None,
        }
    }

    /// The IP set's id, when this is a whole IP set (`IpsetUpdate`), without decoding.
    pub fn ipset_id(&self) -> Option<&str> {
        match &*self.0 {
            Held::Encoded { ipset_id, .. } => Some(ipset_id),
            Held::Message(m) => match &m.payload {
                Some(pb::to_dataplane::Payload::IpsetUpdate(u)) => Some(&u.id),
                _ => None,
            },
        }
    }

    /// The encoded length without a sequence number.
    pub fn encoded_len(&self) -> usize {
        match &*self.0 {
            Held::Encoded { bytes, .. } => bytes.len(),
            Held::Message(m) => prost::Message::encoded_len(m),
        }
    }

    /// An address naming this message while any clone of it lives.
    pub fn addr(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// How many clones of this message exist.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.0)
    }

    /// Whether `a` and `b` are clones of one message.
    pub fn ptr_eq(a: &SharedMessage, b: &SharedMessage) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl std::ops::Deref for SharedMessage {
    type Target = pb::ToDataplane;

    fn deref(&self) -> &pb::ToDataplane {
        match &*self.0 {
            Held::Message(m) => m,
            Held::Encoded { bytes, decoded, .. } => decoded.get_or_init(|| {
                // The bytes were encoded from a valid message by this process.
                bytes.decode().expect("a shared message decodes")
            }),
        }
    }
}

impl From<pb::ToDataplane> for SharedMessage {
    fn from(message: pb::ToDataplane) -> SharedMessage {
        SharedMessage::new(message)
    }
}

impl PartialEq for SharedMessage {
    fn eq(&self, other: &SharedMessage) -> bool {
        SharedMessage::ptr_eq(self, other)
            || match (self.encoded(), other.encoded()) {
                (Some(a), Some(b)) => a == b,
                _ => **self == **other,
            }
    }
}

impl std::fmt::Debug for SharedMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::to_dataplane::Payload;

    fn whole(members: &[&str]) -> pb::ToDataplane {
        super::super::messages::msg(Payload::IpsetUpdate(pb::IpSetUpdate {
            id: "s:abc".into(),
            members: members.iter().map(|m| m.to_string()).collect(),
            r#type: pb::ip_set_update::IpSetType::Ip as i32,
        }))
    }

    #[test]
    fn an_encoded_ipset_reads_as_the_message_it_was_built_from() {
        let m = whole(&["10.0.0.1/32", "10.0.0.2/32"]);
        let s = SharedMessage::whole_ipset("s:abc".into(), &m);
        assert_eq!(s.ipset_id(), Some("s:abc"));
        assert!(s.held_message().is_none(), "held encoded");
        assert_eq!(s.encoded_len(), prost::Message::encoded_len(&m));
        assert_eq!(*s, m);
        assert_eq!(s, SharedMessage::new(m.clone()));
        assert_eq!(s.encoded(), Some(&Encoded::new(&m)));
    }

    #[test]
    fn a_held_message_has_no_encoding_and_names_its_ipset() {
        let s = SharedMessage::new(whole(&[]));
        assert!(s.encoded().is_none());
        assert_eq!(s.ipset_id(), Some("s:abc"));
        let other = SharedMessage::new(super::super::messages::msg(Payload::InSync(pb::InSync {})));
        assert_eq!(other.ipset_id(), None);
        assert_ne!(s, other);
        let c = s.clone();
        assert!(SharedMessage::ptr_eq(&s, &c));
        assert_eq!(s.holders(), 2);
        assert_eq!(s.addr(), c.addr());
    }
}
