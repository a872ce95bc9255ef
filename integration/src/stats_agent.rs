//! A raw Sync client standing in for a node's agent that reports rule hit counters or flow
//! logs: it says hello with the capabilities a test gives, reads its snapshot to InSync
//! (remembering the policies and profiles it was sent, and the capabilities the server agreed
//! to), then sends `RuleStats` deltas or `FlowReport`s as the test asks. The hit counter
//! persistence tests (etcd, Kubernetes), the flow-log tests and the recommendation test use it
//! against a real `calc-server serve`.

use std::collections::BTreeMap;
use std::time::Duration;

use felix_proto as pb;
use felix_proto::calc_server_client::CalcServerClient;
use pb::from_dataplane::Payload as From;
use pb::to_dataplane::Payload as To;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

pub struct StatsAgent {
    tx: mpsc::Sender<pb::FromDataplane>,
    rx: tonic::Streaming<pb::ToDataplane>,
    out: u64,
    /// The capabilities the server's hello listed.
    pub agreed: Vec<String>,
    /// The policies the snapshot carried, by name: their id and ingress rule count.
    pub policies: BTreeMap<String, (pb::PolicyId, usize)>,
    /// The profiles the snapshot carried, by name: their ingress rule count.
    pub profiles: BTreeMap<String, usize>,
}

impl StatsAgent {
    /// Says hello for `node` offering `capabilities` and reads the snapshot to InSync (each
    /// message within 10 s).
    pub async fn connect(url: &str, node: &str, capabilities: &[&str]) -> StatsAgent {
        let mut client = CalcServerClient::connect(url.to_string())
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::FromDataplane {
            sequence_number: 1,
            payload: Some(From::AgentHello(pb::AgentHello {
                node_name: node.into(),
                agent_version: "test".into(),
                capabilities: capabilities.iter().map(|c| (*c).to_owned()).collect(),
            })),
        })
        .await
        .expect("the hello is queued");
        let rx = client
            .sync(ReceiverStream::new(rx))
            .await
            .expect("Sync")
            .into_inner();
        let mut agent = StatsAgent {
            tx,
            rx,
            out: 1,
            agreed: Vec::new(),
            policies: BTreeMap::new(),
            profiles: BTreeMap::new(),
        };
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), agent.rx.next())
                .await
                .expect("a message within 10 s")
                .expect("stream open")
                .expect("no error");
            match m.payload.expect("payload") {
                To::ServerHello(h) => agent.agreed = h.capabilities,
                To::ActivePolicyUpdate(u) => {
                    let id = u.id.expect("a policy id");
                    let rules = u.policy.map_or(0, |p| p.inbound_rules.len());
                    agent.policies.insert(id.name.clone(), (id, rules));
                }
                To::ActiveProfileUpdate(u) => {
                    let name = u.id.expect("a profile id").name;
                    let rules = u.profile.map_or(0, |p| p.inbound_rules.len());
                    agent.profiles.insert(name, rules);
                }
                To::InSync(_) => return agent,
                _ => {}
            }
        }
    }

    /// Reports `packets` (100 bytes each) on ingress rule 0 of `policy` and of `profile`, both
    /// as the snapshot named them.
    pub async fn report(&mut self, policy: &str, profile: &str, packets: u64) {
        let (policy_id, _) = self
            .policies
            .get(policy)
            .unwrap_or_else(|| panic!("{policy} was not in the snapshot"))
            .clone();
        assert!(
            self.profiles.contains_key(profile),
            "{profile} was not in the snapshot"
        );
        let hit = |kind: pb::rule_ref::Kind, policy, profile| pb::RuleHits {
            rule: Some(pb::RuleRef {
                kind: kind as i32,
                policy,
                profile,
                tier: String::new(),
                egress: false,
                index: 0,
            }),
            packets,
            bytes: packets * 100,
        };
        self.out += 1;
        self.tx
            .send(pb::FromDataplane {
                sequence_number: self.out,
                payload: Some(From::RuleStats(pb::RuleStats {
                    hits: vec![
                        hit(pb::rule_ref::Kind::PolicyRule, Some(policy_id), None),
                        hit(
                            pb::rule_ref::Kind::ProfileRule,
                            None,
                            Some(pb::ProfileId {
                                name: profile.to_owned(),
                            }),
                        ),
                    ],
                })),
            })
            .await
            .expect("stream open");
    }

    /// Sends one `FlowReport` of `records` (the agent must have offered `flows`).
    pub async fn send_flows(&mut self, records: Vec<pb::FlowRecord>) {
        self.out += 1;
        self.tx
            .send(pb::FromDataplane {
                sequence_number: self.out,
                payload: Some(From::FlowReport(pb::FlowReport {
                    records,
                    dropped: 0,
                })),
            })
            .await
            .expect("stream open");
    }

    /// Whether the server ended the stream within 10 s (drains what it sends meanwhile).
    pub async fn ended(&mut self) -> bool {
        self.end_status().await.is_some()
    }

    /// The status the server ended the stream with within 10 s (`None`: still open; an end
    /// without an error is `Ok`), draining what it sends meanwhile.
    pub async fn end_status(&mut self) -> Option<tonic::Status> {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.rx.next()).await {
                Err(_) => return None,
                Ok(None) => return Some(tonic::Status::ok("")),
                Ok(Some(Err(e))) => return Some(e),
                Ok(Some(Ok(_))) => {}
            }
        }
    }
}
