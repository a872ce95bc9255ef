//! The `CalcServer.Sync` route as an HTTP service, with a response body of our own.
//!
//! Contract: the same wire protocol as a tonic-generated server of `felixbackend.proto`'s
//! `CalcServer` (the path `/felix.CalcServer/Sync`, gRPC message framing, `grpc-status` in the
//! trailers, or alone in the headers for a stream refused before it starts; any other path is
//! UNIMPLEMENTED, as are compressed requests). The reports the agent sends are read with
//! tonic's decoder. The messages sent are framed here ([`SyncBody`]): small ones are gathered
//! into chunks of about [`CHUNK`] bytes, and a message of at least [`SHARED_MIN`] bytes (a whole
//! IP set: on a 5,000-node cluster a snapshot carries about 3 MB of them) goes to the
//! transport as the one shared encoding every stream sends, between its own prefix and
//! sequence number. tonic's encoder copied every message into each stream's buffer.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http;
use felix_proto as pb;
use hyper::body::{Body, Frame};
use pb::framed;
use pb::prost::bytes::{Bytes, BytesMut};
use tokio_stream::Stream;
use tonic::Status;

use super::service::{Outgoing, SyncService};

/// The route of `CalcServer.Sync` (package `felix`).
pub(super) const SYNC_PATH: &str = "/felix.CalcServer/Sync";

/// What a stream allocates first to read the agent's reports (a `DataplaneApplied` is a few
/// dozen bytes; a larger report grows it). tonic's 8 KiB default, once per stream, was 8 MiB
/// of the server's memory with 1,000 agents (heaptrack).
const RECV_BUFFER: usize = 1024;
const RECV_YIELD: usize = 8 * 1024;

/// A message at least this long is handed over as its shared bytes rather than copied.
const SHARED_MIN: usize = 4 * 1024;

/// How many bytes of small messages a chunk gathers before it is handed over (an HTTP/2 DATA
/// frame is at most 16 KiB).
const CHUNK: usize = 16 * 1024;

/// The Sync route: each request is one agent's stream, served by `service`.
#[derive(Clone)]
pub(super) struct SyncRoute {
    service: Arc<SyncService>,
    /// The longest report accepted (`--max-recv-bytes`).
    max_recv: usize,
}

impl SyncRoute {
    pub(super) fn new(service: SyncService, max_recv: usize) -> SyncRoute {
        SyncRoute {
            service: Arc::new(service),
            max_recv,
        }
    }
}

type Response = http::Response<tonic::body::Body>;

impl<B> tower::Service<http::Request<B>> for SyncRoute
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != SYNC_PATH {
            let status = Status::unimplemented(format!(
                "no method {:?}: this server serves {SYNC_PATH}",
                req.uri().path()
            ));
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        if req
            .headers()
            .get("grpc-encoding")
            .is_some_and(|e| e != "identity")
        {
            let status = Status::unimplemented("compressed reports are not supported");
            return Box::pin(std::future::ready(Ok(status.into_http())));
        }
        let service = self.service.clone();
        let max_recv = self.max_recv;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let decoder =
                framed::report_decoder(tonic::codec::BufferSettings::new(RECV_BUFFER, RECV_YIELD));
            let reports = tonic::codec::Streaming::new_request(decoder, body, None, Some(max_recv));
            let request = tonic::Request::from_http(http::Request::from_parts(parts, reports));
            Ok(match service.open(request).await {
                Ok(out) => {
                    let mut response =
                        http::Response::new(tonic::body::Body::new(SyncBody::new(out)));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc"),
                    );
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

/// The response body of one stream: its messages framed, then the trailers with the status
/// the stream ended with.
pub(super) struct SyncBody {
    out: Outgoing,
    /// Data ready to hand over, in order.
    ready: VecDeque<Bytes>,
    /// How the stream ended (`Some(None)`: OK), once it has; the trailers follow `ready`.
    end: Option<Option<Status>>,
    done: bool,
}

impl SyncBody {
    pub(super) fn new(out: Outgoing) -> SyncBody {
        SyncBody {
            out,
            ready: VecDeque::new(),
            end: None,
            done: false,
        }
    }

    /// Appends `frame` to `buf`, or for a large body hands over what `buf` holds with the
    /// prefix, then the shared body, and starts `buf` again with the sequence number.
    fn put(&mut self, buf: &mut BytesMut, frame: &framed::Frame) {
        if frame.body.len() < SHARED_MIN {
            buf.reserve(frame.framed_len());
            frame.put(buf);
            return;
        }
        buf.reserve(framed::PREFIX_LEN);
        frame.put_prefix(buf);
        self.ready.push_back(buf.split().freeze());
        self.ready.push_back(frame.body_bytes());
        frame.put_sequence_number(buf);
    }

    /// Takes what the stream has ready, up to about a chunk or a large message.
    fn gather(&mut self, cx: &mut Context<'_>) {
        let mut buf = BytesMut::new();
        while buf.len() < CHUNK && self.ready.is_empty() {
            match Pin::new(&mut self.out).poll_next(cx) {
                Poll::Ready(Some(Ok(frame))) => self.put(&mut buf, &frame),
                Poll::Ready(Some(Err(status))) => {
                    self.end = Some(Some(status));
                    break;
                }
                Poll::Ready(None) => {
                    self.end = Some(None);
                    break;
                }
                Poll::Pending => break,
            }
        }
        if !buf.is_empty() {
            self.ready.push_back(buf.freeze());
        }
    }
}

/// The trailers of a stream that ended with `status` (`None`: OK).
fn trailers(status: Option<Status>) -> http::HeaderMap {
    let status = status.unwrap_or_else(|| Status::new(tonic::Code::Ok, ""));
    let mut map = http::HeaderMap::new();
    if let Err(error) = status.add_header(&mut map) {
        // Only a message that cannot be a header value fails: the code alone still goes.
        tracing::debug!(%error, "a stream status without its message");
        map.insert("grpc-status", http::HeaderValue::from(status.code() as i32));
    }
    map
}

impl Body for SyncBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(data) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(status) = this.end.take() {
                this.done = true;
                return Poll::Ready(Some(Ok(Frame::trailers(trailers(status)))));
            }
            this.gather(cx);
            if this.ready.is_empty() && this.end.is_none() {
                return Poll::Pending;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.ready.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use calc_graph::graph::SharedMessage;
    use pb::prost::Message;
    use pb::to_dataplane::Payload;
    use tokio::sync::{mpsc, oneshot};

    use super::*;
    use crate::serve::engine::{CloseReason, Out};
    use crate::serve::service::outgoing;

    fn msg(payload: Payload) -> pb::ToDataplane {
        pb::ToDataplane {
            sequence_number: 0,
            payload: Some(payload),
        }
    }

    /// Polls `body` to its end: the data, in order, each piece as handed over, then the
    /// trailers.
    async fn drain(mut body: SyncBody) -> (Vec<Bytes>, http::HeaderMap) {
        let mut data = Vec::new();
        loop {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
            let frame = frame.expect("trailers come before the end").unwrap();
            match frame.into_data() {
                Ok(d) => data.push(d),
                Err(frame) => {
                    let trailers = frame.into_trailers().expect("data or trailers");
                    assert!(
                        std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
                            .await
                            .is_none()
                    );
                    assert!(body.is_end_stream());
                    return (data, trailers);
                }
            }
        }
    }

    #[tokio::test]
    async fn the_body_frames_every_message_in_order_sharing_large_ones_then_the_status() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (_fault, fault_rx) = oneshot::channel();
        let hello = msg(Payload::ServerHello(pb::ServerHello::default()));
        let out = outgoing(
            hello.clone(),
            rx,
            fault_rx,
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Default::default(),
        );
        let ipset = |n: usize| {
            msg(Payload::IpsetUpdate(pb::IpSetUpdate {
                id: format!("s:{n}"),
                members: (0..n)
                    .map(|i| format!("10.0.{}.{}/32", i / 256, i % 256))
                    .collect(),
                r#type: 0,
            }))
        };
        let large = pb::framed::Encoded::new(&ipset(1000));
        assert!(large.len() >= SHARED_MIN);
        let sent = [
            msg(Payload::ConfigUpdate(pb::ConfigUpdate::default())),
            ipset(2),
            ipset(1000),
            msg(Payload::InSync(pb::InSync {})),
        ];
        for m in &sent {
            let m = SharedMessage::new(m.clone());
            let len = m.encoded_len() as u64;
            tx.send(Out::Msg(m, len)).unwrap();
        }
        tx.send(Out::Close(CloseReason::ShuttingDown)).unwrap();

        let (data, trailers) = drain(SyncBody::new(out)).await;
        assert!(
            data.iter().any(|d| d[..] == *large.as_slice()),
            "the large message is handed over as its encoding alone, not copied into a chunk"
        );
        let stream: Vec<u8> = data.concat();
        let mut rest = &stream[..];
        let mut received = Vec::new();
        while !rest.is_empty() {
            assert_eq!(rest[0], 0, "uncompressed");
            let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
            received.push(pb::ToDataplane::decode(&rest[5..5 + len]).expect("a message"));
            rest = &rest[5 + len..];
        }
        let expected: Vec<pb::ToDataplane> = std::iter::once(hello)
            .chain(sent)
            .zip(1..)
            .map(|(m, seq)| pb::ToDataplane {
                sequence_number: seq,
                ..m
            })
            .collect();
        assert_eq!(received, expected);
        let status = Status::from_header_map(&trailers).expect("a status");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("shutting down"), "{status:?}");
    }

    #[tokio::test]
    async fn a_stream_that_ends_cleanly_says_ok() {
        let (tx, rx) = mpsc::unbounded_channel::<Out>();
        let (_fault, fault_rx) = oneshot::channel();
        let hello = msg(Payload::ServerHello(pb::ServerHello::default()));
        let out = outgoing(
            hello,
            rx,
            fault_rx,
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Default::default(),
        );
        drop(tx);
        let (data, trailers) = drain(SyncBody::new(out)).await;
        assert_eq!(data.len(), 1, "the hello");
        assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    }

    #[tokio::test]
    async fn another_method_or_a_compressed_stream_is_unimplemented() {
        let (engine, _rx) = mpsc::channel(1);
        let service = SyncService {
            engine,
            flow_logs: false,
            flow_rate: 1,
            board: Default::default(),
            hello_timeout: std::time::Duration::from_secs(1),
            next_id: AtomicU64::new(1),
            metrics: Default::default(),
            tasks: common::Tasks::new(),
        };
        let mut route = SyncRoute::new(service, 1024);
        for (path, encoding) in [("/felix.CalcServer/Other", None), (SYNC_PATH, Some("gzip"))] {
            let mut req = http::Request::post(path);
            if let Some(e) = encoding {
                req = req.header("grpc-encoding", e);
            }
            let req = req.body(tonic::body::Body::empty()).unwrap();
            let response = tower::Service::call(&mut route, req).await.unwrap();
            let status = Status::from_header_map(response.headers()).expect("a status");
            assert_eq!(status.code(), tonic::Code::Unimplemented, "{path}");
        }
    }
}
