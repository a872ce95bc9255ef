//! Pre-encoded `ToDataplane` messages framed for the server side of `CalcServer.Sync`.
//!
//! A message the calculation graph shares between nodes (an IP set, a policy) is encoded once
//! ([`Encoded`]); each node's stream then writes the gRPC message prefix, those bytes, and its
//! own sequence number (field 15, after the payload as prost writes it). The bytes on the wire
//! are exactly those of the equivalent `ToDataplane` in a gRPC message: agents, and any client
//! built from Calico's proto, see no difference. The server's response body writes these frames
//! itself, so a large body can go to the transport without a copy; the agent's reports are
//! read with tonic's decoder ([`report_decoder`]).

use prost::bytes::{BufMut, Bytes};

pub use crate::encoded::Encoded;

/// `ToDataplane.sequence_number`'s field number (Calico's).
const SEQUENCE_NUMBER_TAG: u32 = 15;

/// The length of the gRPC message prefix: the compression flag and the big-endian length.
pub const PREFIX_LEN: usize = 5;

/// One message of a node's stream: its sequence number and the shared encoded body.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Frame {
    pub sequence_number: u64,
    pub body: Encoded,
}

impl Frame {
    /// The length of the sequence number field (none for 0, as prost leaves a default out).
    fn sequence_number_len(&self) -> usize {
        if self.sequence_number == 0 {
            0
        } else {
            prost::encoding::uint64::encoded_len(SEQUENCE_NUMBER_TAG, &self.sequence_number)
        }
    }

    /// The length of the `ToDataplane` this frame stands for.
    pub fn message_len(&self) -> usize {
        self.body.len() + self.sequence_number_len()
    }

    /// The length of the whole gRPC message: prefix, body and sequence number.
    pub fn framed_len(&self) -> usize {
        PREFIX_LEN + self.message_len()
    }

    /// Appends the gRPC message prefix (uncompressed, this message's length).
    pub fn put_prefix(&self, buf: &mut impl BufMut) {
        let len = u32::try_from(self.message_len()).expect("a message under 4 GiB");
        buf.put_u8(0);
        buf.put_u32(len);
    }

    /// Appends the sequence number field, which follows the body.
    pub fn put_sequence_number(&self, buf: &mut impl BufMut) {
        if self.sequence_number != 0 {
            prost::encoding::uint64::encode(SEQUENCE_NUMBER_TAG, &self.sequence_number, buf);
        }
    }

    /// Appends the whole gRPC message (prefix, body, sequence number), copying the body.
    pub fn put(&self, buf: &mut impl BufMut) {
        self.put_prefix(buf);
        buf.put_slice(self.body.as_slice());
        self.put_sequence_number(buf);
    }

    /// The body's bytes, shared (what a large body is handed to the transport as, between
    /// its prefix and its sequence number).
    pub fn body_bytes(&self) -> Bytes {
        self.body.to_bytes()
    }
}

/// tonic's decoder of the agent's reports, its buffer sized by `settings`.
pub fn report_decoder(
    settings: tonic::codec::BufferSettings,
) -> tonic_prost::ProstDecoder<crate::FromDataplane> {
    tonic_prost::ProstDecoder::new(settings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ToDataplane;
    use crate::to_dataplane::Payload;
    use prost::Message;

    /// The gRPC message of `msg` as a client reads it: prefix, then the encoding.
    fn grpc_message(msg: &ToDataplane) -> Vec<u8> {
        let bytes = msg.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
        out
    }

    #[test]
    fn a_frame_is_byte_for_byte_the_message_it_stands_for() {
        let payload = Payload::IpsetUpdate(crate::IpSetUpdate {
            id: "s:abc".into(),
            members: vec!["10.0.0.1/32".into(), "10.0.0.2/32".into()],
            r#type: crate::ip_set_update::IpSetType::Ip as i32,
        });
        for seq in [0, 1, 127, 128, 300, u64::MAX] {
            let msg = ToDataplane {
                sequence_number: seq,
                payload: Some(payload.clone()),
            };
            let frame = Frame {
                sequence_number: seq,
                body: Encoded::new(&msg),
            };
            let mut whole = Vec::new();
            frame.put(&mut whole);
            assert_eq!(whole, grpc_message(&msg), "seq {seq}");
            assert_eq!(frame.message_len(), msg.encoded_len());
            assert_eq!(frame.framed_len(), whole.len());
            // In three pieces, the body shared: the same bytes.
            let mut pieces = Vec::new();
            frame.put_prefix(&mut pieces);
            pieces.extend_from_slice(&frame.body_bytes());
            frame.put_sequence_number(&mut pieces);
            assert_eq!(pieces, whole, "seq {seq}");
        }
    }

    #[test]
    fn one_encoding_serves_every_sequence_number() {
        let msg = ToDataplane {
            sequence_number: 5,
            payload: Some(Payload::InSync(crate::InSync {})),
        };
        let body = Encoded::new(&msg);
        for seq in [2, 9] {
            let mut bytes = Vec::new();
            Frame {
                sequence_number: seq,
                body: body.clone(),
            }
            .put(&mut bytes);
            let decoded = ToDataplane::decode(&bytes[PREFIX_LEN..]).unwrap();
            assert_eq!(decoded.sequence_number, seq);
            assert_eq!(decoded.payload, msg.payload);
        }
    }
}
