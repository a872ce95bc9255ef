//! Pre-encoded `ToDataplane` messages for the server side of `CalcServer.Sync`.
//!
//! A message the calculation graph shares between nodes (an IP set, a policy) is encoded once;
//! each node's stream then writes those bytes followed by its own sequence number (field 15,
//! after the payload as prost writes it). The bytes on the wire are exactly those of the
//! equivalent `ToDataplane`: agents, and any client built from Calico's proto, see no
//! difference.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType};

#[cfg(test)]
use crate::ToDataplane;
pub use crate::encoded::Encoded;

/// `ToDataplane.sequence_number`'s field number (Calico's).
const SEQUENCE_NUMBER_TAG: u32 = 15;

/// One message of a node's stream: its sequence number and the shared encoded body.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Frame {
    pub sequence_number: u64,
    pub body: Encoded,
}

impl prost::Message for Frame {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(self.body.as_slice());
        if self.sequence_number != 0 {
            prost::encoding::uint64::encode(SEQUENCE_NUMBER_TAG, &self.sequence_number, buf);
        }
    }

    // Frames are only ever sent: decoding one (which nothing does) skips every field.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        let seq = if self.sequence_number != 0 {
            prost::encoding::uint64::encoded_len(SEQUENCE_NUMBER_TAG, &self.sequence_number)
        } else {
            0
        };
        seq + self.body.len()
    }

    fn clear(&mut self) {
        *self = Frame::default();
    }
}

/// How many encoded bytes a stream gathers before handing them to the transport, and what it
/// allocates first. With tonic's defaults (8 KiB, handing over at 32 KiB) each chunk pins a
/// buffer that grows to 64 KiB while the transport holds it, and a stream whose agent reads
/// slowly holds several: 1,000 agents syncing at once kept about 100 MiB there (heaptrack).
/// HTTP/2 sends DATA frames of at most 16 KiB anyway.
const SEND_BUFFER: usize = 4 * 1024;
const SEND_YIELD: usize = 8 * 1024;

/// What a stream allocates first to read the agent's reports (a `DataplaneApplied` is a few
/// dozen bytes; a larger report grows it). tonic's 8 KiB default, once per stream, was 8 MiB
/// of the server's memory with 1,000 agents (heaptrack).
const RECV_BUFFER: usize = 1024;

/// The codec of the [`server`]: [`Frame`]s out with small send buffers, `FromDataplane` in.
// Not a unit struct: the generated server builds it with `default()`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FrameCodec {
    _private: (),
}

impl tonic::codec::Codec for FrameCodec {
    type Encode = Frame;
    type Decode = crate::FromDataplane;
    type Encoder = tonic_prost::ProstEncoder<Frame>;
    type Decoder = tonic_prost::ProstDecoder<crate::FromDataplane>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::new(tonic::codec::BufferSettings::new(SEND_BUFFER, SEND_YIELD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(tonic::codec::BufferSettings::new(RECV_BUFFER, SEND_YIELD))
    }
}

/// The server of `CalcServer.Sync` sending [`Frame`]s (same route, same wire format).
pub mod server {
    include!(concat!(env!("OUT_DIR"), "/framed/felix.CalcServer.rs"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::to_dataplane::Payload;
    use prost::Message;

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
            assert_eq!(frame.encode_to_vec(), msg.encode_to_vec(), "seq {seq}");
            assert_eq!(frame.encoded_len(), msg.encoded_len());
            assert_eq!(ToDataplane::decode(&*frame.encode_to_vec()).unwrap(), msg);
        }
    }

    #[test]
    fn one_encoding_serves_every_sequence_number() {
        let msg = ToDataplane {
            sequence_number: 5,
            payload: Some(Payload::InSync(crate::InSync {})),
        };
        let body = Encoded::new(&msg);
        let a = Frame {
            sequence_number: 2,
            body: body.clone(),
        }
        .encode_to_vec();
        let b = Frame {
            sequence_number: 9,
            body,
        }
        .encode_to_vec();
        assert_eq!(ToDataplane::decode(&*a).unwrap().sequence_number, 2);
        assert_eq!(ToDataplane::decode(&*b).unwrap().sequence_number, 9);
    }
}
