//! The typed boundary between the stream and the drivers.
//!
//! Every `ToDataplane` the session receives is converted here, once, into an [`Inbound`]: the
//! sequence number and what the message carries ([`Received`]): the session's `ServerHello`, a
//! [`Message`] for the driver, or an unknown payload. Drivers and the tracker only ever see
//! [`Message`]s, whose object keys ([`PolicyKey`], [`ProfileKey`], [`WorkloadEndpointKey`],
//! [`HostEndpointKey`], [`IpSetId`], …) were built here and whose required parts are present.
//!
//! Contract:
//!
//! * The conversion destructures `ToDataplane`, every payload and every id exhaustively (no
//!   `..`, no `_ =>`): a field or payload added to `felixbackend.proto` is a compile error here
//!   until someone decides what it means for the agent.
//! * A message that does not say which object it is about (a missing id, or an id with every
//!   field empty: proto3 cannot tell the two apart), an update without its object, or an enum
//!   value outside the proto's enumeration is an [`InvalidMessage`] naming the payload kind and
//!   whatever key it has. Nothing is default-filled: an object keyed by empty strings never
//!   reaches a driver. What the session does with the error is in `session.rs`.
//! * Only presence and enumerations are checked here. Whether a present value is acceptable to
//!   the kernel (a hostile name, a bad CIDR) is the driver's to judge per object, so that one
//!   bad object fails closed on its own and the rest of the stream still applies.
//! * Object bodies (`Policy`, `WorkloadEndpoint`, …) stay the proto types: they are what the
//!   renderers and the dry-run state file (the proto3 JSON mapping) consume.
//! * A payload field left unset (`payload: None`) is what prost decodes a newer server's unknown
//!   payload to: it is [`Received::Unknown`], not an error, so an older agent keeps working.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;

pub use felix_proto::ip_set_update::IpSetType;
use felix_proto::to_dataplane::Payload;
use felix_proto::{
    ActivePolicyRemove, ActivePolicyUpdate, ActiveProfileRemove, ActiveProfileUpdate, ConfigUpdate,
    Encapsulation, GlobalBgpConfigUpdate, HostEndpoint, HostEndpointId, HostEndpointRemove,
    HostEndpointUpdate, HostMetadataRemove, HostMetadataUpdate, InSync, IpSetDeltaUpdate,
    IpSetRemove, IpSetUpdate, IpamPool, IpamPoolRemove, IpamPoolUpdate, NamespaceId,
    NamespaceRemove, NamespaceUpdate, Policy, PolicyId, Profile, ProfileId, RouteRemove,
    RouteUpdate, ServerHello, ServiceAccountId, ServiceAccountRemove, ServiceAccountUpdate,
    ServiceRemove, ServiceUpdate, ToDataplane, VxlanTunnelEndpointRemove,
    VxlanTunnelEndpointUpdate, WireguardEndpointRemove, WireguardEndpointUpdate,
    WireguardEndpointV6Remove, WireguardEndpointV6Update, WorkloadEndpoint, WorkloadEndpointId,
    WorkloadEndpointRemove, WorkloadEndpointUpdate,
};

/// One `ToDataplane`, converted.
#[derive(Clone, Debug, PartialEq)]
pub struct Inbound {
    /// The server's sequence number (checked by the session).
    pub sequence_number: u64,
    /// What it carries.
    pub received: Received,
}

/// What a `ToDataplane` carries.
#[derive(Clone, Debug, PartialEq)]
pub enum Received {
    /// The stream's opening message: the session's, never given to a driver.
    ServerHello(ServerHello),
    /// A message for the driver.
    Message(Message),
    /// A staged policy's update or removal: the server computes staged policies (explain's
    /// pending verdicts), and no driver programs them.
    Staged(PolicyKey),
    /// No payload, or one this agent does not know (a newer server's): ignored.
    Unknown,
}

impl Received {
    /// The proto name of the payload, for logs ("empty payload" when there is none).
    pub fn kind(&self) -> &'static str {
        match self {
            Received::ServerHello(_) => "ServerHello",
            Received::Message(m) => m.kind(),
            Received::Staged(_) => "staged policy",
            Received::Unknown => "empty payload",
        }
    }
}

/// A message for a driver: one per `ToDataplane` payload but `ServerHello`, with its object's
/// key typed and its required parts present.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// The snapshot is complete.
    InSync,
    /// The effective Felix configuration.
    Config(ConfigUpdate),
    /// A set with all of its members; replaces any earlier version.
    IpSetUpdate {
        id: IpSetId,
        set_type: IpSetType,
        members: Vec<String>,
    },
    /// Members added to and removed from a set sent before.
    IpSetDeltaUpdate {
        id: IpSetId,
        added: Vec<String>,
        removed: Vec<String>,
    },
    IpSetRemove {
        id: IpSetId,
    },
    PolicyUpdate {
        key: PolicyKey,
        policy: Policy,
    },
    PolicyRemove {
        key: PolicyKey,
    },
    ProfileUpdate {
        key: ProfileKey,
        profile: Profile,
    },
    ProfileRemove {
        key: ProfileKey,
    },
    /// Endpoint bodies are boxed: they are several times the size of any other message, and
    /// a snapshot holds one per endpoint until its `InSync`.
    WorkloadEndpointUpdate {
        key: WorkloadEndpointKey,
        endpoint: Box<WorkloadEndpoint>,
    },
    WorkloadEndpointRemove {
        key: WorkloadEndpointKey,
    },
    HostEndpointUpdate {
        key: HostEndpointKey,
        endpoint: Box<HostEndpoint>,
    },
    HostEndpointRemove {
        key: HostEndpointKey,
    },
    /// Some node's addresses; `metadata` is the whole proto message (its `hostname` is `host`).
    HostMetadataUpdate {
        host: HostName,
        metadata: HostMetadataUpdate,
    },
    HostMetadataRemove {
        host: HostName,
        ipv4_addr: String,
    },
    IpamPoolUpdate {
        id: IpamPoolId,
        pool: IpamPool,
    },
    IpamPoolRemove {
        id: IpamPoolId,
    },
    ServiceAccountUpdate {
        key: ServiceAccountKey,
        labels: BTreeMap<String, String>,
    },
    ServiceAccountRemove {
        key: ServiceAccountKey,
    },
    NamespaceUpdate {
        key: NamespaceKey,
        labels: BTreeMap<String, String>,
    },
    NamespaceRemove {
        key: NamespaceKey,
    },
    /// `route` is the whole proto message (its `dst` is `dst`).
    RouteUpdate {
        dst: RouteDst,
        route: RouteUpdate,
    },
    RouteRemove {
        dst: RouteDst,
    },
    /// `vtep` is the whole proto message (its `node` is `node`).
    VtepUpdate {
        node: VtepNode,
        vtep: VxlanTunnelEndpointUpdate,
    },
    VtepRemove {
        node: VtepNode,
    },
    WireguardEndpointUpdate {
        host: HostName,
        endpoint: WireguardEndpointUpdate,
    },
    WireguardEndpointRemove {
        host: HostName,
    },
    WireguardEndpointV6Update {
        host: HostName,
        endpoint: WireguardEndpointV6Update,
    },
    WireguardEndpointV6Remove {
        host: HostName,
    },
    GlobalBgpConfig(GlobalBgpConfigUpdate),
    Encapsulation(Encapsulation),
    /// `service` is the whole proto message (its namespace and name are `key`).
    ServiceUpdate {
        key: ServiceKey,
        service: ServiceUpdate,
    },
    ServiceRemove {
        key: ServiceKey,
    },
}

impl Message {
    /// The proto name of the payload this came from, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::InSync => "InSync",
            Message::Config(_) => "ConfigUpdate",
            Message::IpSetUpdate { .. } => "IPSetUpdate",
            Message::IpSetDeltaUpdate { .. } => "IPSetDeltaUpdate",
            Message::IpSetRemove { .. } => "IPSetRemove",
            Message::PolicyUpdate { .. } => "ActivePolicyUpdate",
            Message::PolicyRemove { .. } => "ActivePolicyRemove",
            Message::ProfileUpdate { .. } => "ActiveProfileUpdate",
            Message::ProfileRemove { .. } => "ActiveProfileRemove",
            Message::WorkloadEndpointUpdate { .. } => "WorkloadEndpointUpdate",
            Message::WorkloadEndpointRemove { .. } => "WorkloadEndpointRemove",
            Message::HostEndpointUpdate { .. } => "HostEndpointUpdate",
            Message::HostEndpointRemove { .. } => "HostEndpointRemove",
            Message::HostMetadataUpdate { .. } => "HostMetadataUpdate",
            Message::HostMetadataRemove { .. } => "HostMetadataRemove",
            Message::IpamPoolUpdate { .. } => "IPAMPoolUpdate",
            Message::IpamPoolRemove { .. } => "IPAMPoolRemove",
            Message::ServiceAccountUpdate { .. } => "ServiceAccountUpdate",
            Message::ServiceAccountRemove { .. } => "ServiceAccountRemove",
            Message::NamespaceUpdate { .. } => "NamespaceUpdate",
            Message::NamespaceRemove { .. } => "NamespaceRemove",
            Message::RouteUpdate { .. } => "RouteUpdate",
            Message::RouteRemove { .. } => "RouteRemove",
            Message::VtepUpdate { .. } => "VXLANTunnelEndpointUpdate",
            Message::VtepRemove { .. } => "VXLANTunnelEndpointRemove",
            Message::WireguardEndpointUpdate { .. } => "WireguardEndpointUpdate",
            Message::WireguardEndpointRemove { .. } => "WireguardEndpointRemove",
            Message::WireguardEndpointV6Update { .. } => "WireguardEndpointV6Update",
            Message::WireguardEndpointV6Remove { .. } => "WireguardEndpointV6Remove",
            Message::GlobalBgpConfig(_) => "GlobalBGPConfigUpdate",
            Message::Encapsulation(_) => "Encapsulation",
            Message::ServiceUpdate { .. } => "ServiceUpdate",
            Message::ServiceRemove { .. } => "ServiceRemove",
        }
    }
}

/// Why a message from the server cannot be taken as sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidMessage {
    /// The message does not say which object it is about.
    #[error("{kind} without an id")]
    MissingId {
        /// The payload's proto name.
        kind: &'static str,
    },
    /// An update without the object it updates.
    #[error("{kind} {key} without its {field}")]
    MissingField {
        kind: &'static str,
        /// The object's key, quoted and cut as `calico_names::validate::shown` does.
        key: String,
        field: &'static str,
    },
    /// A payload that is not a driver's (`ServerHello` belongs to the session).
    #[error("{kind} is the session's, not a driver's")]
    NotForDriver { kind: &'static str },
    /// An enumeration value the proto does not define.
    #[error("{kind} {key}: {field} {value} is not a known value")]
    UnknownEnumValue {
        kind: &'static str,
        key: String,
        field: &'static str,
        value: i32,
    },
}

impl InvalidMessage {
    /// The payload's proto name.
    pub fn kind(&self) -> &'static str {
        match self {
            InvalidMessage::MissingId { kind }
            | InvalidMessage::NotForDriver { kind }
            | InvalidMessage::MissingField { kind, .. }
            | InvalidMessage::UnknownEnumValue { kind, .. } => kind,
        }
    }

    /// The key of the object the message is about, quoted, when it has one.
    pub fn key(&self) -> Option<&str> {
        match self {
            InvalidMessage::MissingId { .. } | InvalidMessage::NotForDriver { .. } => None,
            InvalidMessage::MissingField { key, .. }
            | InvalidMessage::UnknownEnumValue { key, .. } => Some(key),
        }
    }
}

impl TryFrom<ToDataplane> for Inbound {
    type Error = InvalidMessage;

    fn try_from(msg: ToDataplane) -> Result<Self, InvalidMessage> {
        let ToDataplane {
            sequence_number,
            payload,
        } = msg;
        let received = match payload {
            None => Received::Unknown,
            Some(payload) => Received::try_from(payload)?,
        };
        Ok(Inbound {
            sequence_number,
            received,
        })
    }
}

impl TryFrom<Payload> for Received {
    type Error = InvalidMessage;

    fn try_from(payload: Payload) -> Result<Self, InvalidMessage> {
        message(payload)
    }
}

impl TryFrom<Payload> for Message {
    type Error = InvalidMessage;

    /// The driver message of a payload; a `ServerHello` is refused (it is the session's).
    fn try_from(payload: Payload) -> Result<Self, InvalidMessage> {
        match message(payload)? {
            Received::Message(m) => Ok(m),
            other => Err(InvalidMessage::NotForDriver { kind: other.kind() }),
        }
    }
}

/// A string id that proto3 cannot tell from an absent one.
fn present(kind: &'static str, id: String) -> Result<String, InvalidMessage> {
    if id.is_empty() {
        Err(InvalidMessage::MissingId { kind })
    } else {
        Ok(id)
    }
}

/// A message-typed id: absent, or present with every field empty, is missing.
fn present_id<T: Default + PartialEq>(
    kind: &'static str,
    id: Option<T>,
) -> Result<T, InvalidMessage> {
    match id {
        Some(id) if id != T::default() => Ok(id),
        _ => Err(InvalidMessage::MissingId { kind }),
    }
}

/// The object an update carries.
fn body<T>(
    kind: &'static str,
    key: &dyn fmt::Display,
    field: &'static str,
    value: Option<T>,
) -> Result<T, InvalidMessage> {
    value.ok_or_else(|| InvalidMessage::MissingField {
        kind,
        key: calico_names::validate::shown(&key.to_string()),
        field,
    })
}

/// An endpoint's tier lists as the dataplane enforces them: staged policies taken out. A tier
/// is kept even when nothing is left in it, as Felix keeps it: the renderer skips a direction
/// with no policy (so a tier of staged policies only has no end-of-tier drop), and a host
/// endpoint with forward tiers, staged ones included, gets no allow-by-default forward chain.
fn without_staged(tiers: &mut [felix_proto::TierInfo]) {
    let staged = |id: &PolicyId| calico_names::is_staged_policy_kind(&id.kind);
    for t in tiers.iter_mut() {
        t.ingress_policies.retain(|id| !staged(id));
        t.egress_policies.retain(|id| !staged(id));
    }
}

fn message(payload: Payload) -> Result<Received, InvalidMessage> {
    use Message as M;
    let m = match payload {
        Payload::ServerHello(hello) => return Ok(Received::ServerHello(hello)),
        Payload::InSync(InSync {}) => M::InSync,
        Payload::ConfigUpdate(config) => M::Config(config),
        Payload::IpsetUpdate(IpSetUpdate {
            id,
            members,
            r#type,
        }) => {
            const KIND: &str = "IPSetUpdate";
            let id = IpSetId(present(KIND, id)?);
            let set_type =
                IpSetType::try_from(r#type).map_err(|_| InvalidMessage::UnknownEnumValue {
                    kind: KIND,
                    key: calico_names::validate::shown(id.as_str()),
                    field: "type",
                    value: r#type,
                })?;
            M::IpSetUpdate {
                id,
                set_type,
                members,
            }
        }
        Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
            id,
            added_members,
            removed_members,
        }) => M::IpSetDeltaUpdate {
            id: IpSetId(present("IPSetDeltaUpdate", id)?),
            added: added_members,
            removed: removed_members,
        },
        Payload::IpsetRemove(IpSetRemove { id }) => M::IpSetRemove {
            id: IpSetId(present("IPSetRemove", id)?),
        },
        Payload::ActivePolicyUpdate(ActivePolicyUpdate { id, policy }) => {
            const KIND: &str = "ActivePolicyUpdate";
            let key = PolicyKey::from(present_id(KIND, id)?);
            let policy = body(KIND, &key, "policy", policy)?;
            if calico_names::is_staged_policy_kind(&key.kind) {
                return Ok(Received::Staged(key));
            }
            M::PolicyUpdate { key, policy }
        }
        Payload::ActivePolicyRemove(ActivePolicyRemove { id }) => {
            let key = PolicyKey::from(present_id("ActivePolicyRemove", id)?);
            if calico_names::is_staged_policy_kind(&key.kind) {
                return Ok(Received::Staged(key));
            }
            M::PolicyRemove { key }
        }
        Payload::ActiveProfileUpdate(ActiveProfileUpdate { id, profile }) => {
            const KIND: &str = "ActiveProfileUpdate";
            let key = ProfileKey::from(present_id(KIND, id)?);
            let profile = body(KIND, &key, "profile", profile)?;
            M::ProfileUpdate { key, profile }
        }
        Payload::ActiveProfileRemove(ActiveProfileRemove { id }) => M::ProfileRemove {
            key: present_id("ActiveProfileRemove", id)?.into(),
        },
        Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate { id, endpoint }) => {
            const KIND: &str = "WorkloadEndpointUpdate";
            let key = WorkloadEndpointKey::from(present_id(KIND, id)?);
            let mut endpoint = Box::new(body(KIND, &key, "endpoint", endpoint)?);
            without_staged(&mut endpoint.tiers);
            M::WorkloadEndpointUpdate { key, endpoint }
        }
        Payload::WorkloadEndpointRemove(WorkloadEndpointRemove { id }) => {
            M::WorkloadEndpointRemove {
                key: present_id("WorkloadEndpointRemove", id)?.into(),
            }
        }
        Payload::HostEndpointUpdate(HostEndpointUpdate { id, endpoint }) => {
            const KIND: &str = "HostEndpointUpdate";
            let key = HostEndpointKey::from(present_id(KIND, id)?);
            let mut endpoint = Box::new(body(KIND, &key, "endpoint", endpoint)?);
            for tiers in [
                &mut endpoint.tiers,
                &mut endpoint.untracked_tiers,
                &mut endpoint.pre_dnat_tiers,
                &mut endpoint.forward_tiers,
            ] {
                without_staged(tiers);
            }
            M::HostEndpointUpdate { key, endpoint }
        }
        Payload::HostEndpointRemove(HostEndpointRemove { id }) => M::HostEndpointRemove {
            key: present_id("HostEndpointRemove", id)?.into(),
        },
        Payload::HostMetadataUpdate(metadata) => M::HostMetadataUpdate {
            host: HostName(present("HostMetadataUpdate", metadata.hostname.clone())?),
            metadata,
        },
        Payload::HostMetadataRemove(HostMetadataRemove {
            hostname,
            ipv4_addr,
        }) => M::HostMetadataRemove {
            host: HostName(present("HostMetadataRemove", hostname)?),
            ipv4_addr,
        },
        Payload::IpamPoolUpdate(IpamPoolUpdate { id, pool }) => {
            const KIND: &str = "IPAMPoolUpdate";
            let id = IpamPoolId(present(KIND, id)?);
            let pool = body(KIND, &id, "pool", pool)?;
            M::IpamPoolUpdate { id, pool }
        }
        Payload::IpamPoolRemove(IpamPoolRemove { id }) => M::IpamPoolRemove {
            id: IpamPoolId(present("IPAMPoolRemove", id)?),
        },
        Payload::ServiceAccountUpdate(ServiceAccountUpdate { id, labels }) => {
            M::ServiceAccountUpdate {
                key: present_id("ServiceAccountUpdate", id)?.into(),
                labels,
            }
        }
        Payload::ServiceAccountRemove(ServiceAccountRemove { id }) => M::ServiceAccountRemove {
            key: present_id("ServiceAccountRemove", id)?.into(),
        },
        Payload::NamespaceUpdate(NamespaceUpdate { id, labels }) => M::NamespaceUpdate {
            key: present_id("NamespaceUpdate", id)?.into(),
            labels,
        },
        Payload::NamespaceRemove(NamespaceRemove { id }) => M::NamespaceRemove {
            key: present_id("NamespaceRemove", id)?.into(),
        },
        Payload::RouteUpdate(route) => M::RouteUpdate {
            dst: RouteDst(present("RouteUpdate", route.dst.clone())?),
            route,
        },
        Payload::RouteRemove(RouteRemove { dst }) => M::RouteRemove {
            dst: RouteDst(present("RouteRemove", dst)?),
        },
        Payload::VtepUpdate(vtep) => M::VtepUpdate {
            node: VtepNode(present("VXLANTunnelEndpointUpdate", vtep.node.clone())?),
            vtep,
        },
        Payload::VtepRemove(VxlanTunnelEndpointRemove { node }) => M::VtepRemove {
            node: VtepNode(present("VXLANTunnelEndpointRemove", node)?),
        },
        Payload::WireguardEndpointUpdate(endpoint) => M::WireguardEndpointUpdate {
            host: HostName(present(
                "WireguardEndpointUpdate",
                endpoint.hostname.clone(),
            )?),
            endpoint,
        },
        Payload::WireguardEndpointRemove(WireguardEndpointRemove { hostname }) => {
            M::WireguardEndpointRemove {
                host: HostName(present("WireguardEndpointRemove", hostname)?),
            }
        }
        Payload::WireguardEndpointV6Update(endpoint) => M::WireguardEndpointV6Update {
            host: HostName(present(
                "WireguardEndpointV6Update",
                endpoint.hostname.clone(),
            )?),
            endpoint,
        },
        Payload::WireguardEndpointV6Remove(WireguardEndpointV6Remove { hostname }) => {
            M::WireguardEndpointV6Remove {
                host: HostName(present("WireguardEndpointV6Remove", hostname)?),
            }
        }
        Payload::GlobalBgpConfigUpdate(config) => M::GlobalBgpConfig(config),
        Payload::Encapsulation(encapsulation) => M::Encapsulation(encapsulation),
        Payload::ServiceUpdate(service) => {
            let key = ServiceKey {
                namespace: service.namespace.clone(),
                name: present("ServiceUpdate", service.name.clone())?,
            };
            M::ServiceUpdate { key, service }
        }
        Payload::ServiceRemove(ServiceRemove { name, namespace }) => M::ServiceRemove {
            key: ServiceKey {
                namespace,
                name: present("ServiceRemove", name)?,
            },
        },
    };
    Ok(Received::Message(m))
}

/// Keys that are one string: quoted by `Debug` exactly as the `String` they wrap, so log lines
/// and refusal keys read as they did before the keys were typed; `Borrow<str>` lets maps keyed
/// by them be searched with the names object bodies carry (`profile_ids`, rule IP set ids).
macro_rules! string_key {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(String);

        impl $name {
            /// The key of this name (as an object body refers to it).
            pub fn new(s: impl Into<String>) -> Self {
                Self(s.into())
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl From<$name> for String {
            fn from(k: $name) -> String {
                k.0
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }
    };
}

string_key!(
    /// An IP set's id (`s:…`, `n:…`, `svc:…`), as rules name it.
    IpSetId
);
string_key!(
    /// A profile's name (`kns.<namespace>`, `ksa.<namespace>.<sa>`, …), as endpoints list it.
    ProfileKey
);
string_key!(
    /// A host endpoint's id (its HostEndpoint resource name).
    HostEndpointKey
);
string_key!(
    /// An IPAM pool's id.
    IpamPoolId
);
string_key!(
    /// A node's hostname (host metadata, wireguard peers).
    HostName
);
string_key!(
    /// A route's destination CIDR.
    RouteDst
);
string_key!(
    /// The node a VXLAN tunnel endpoint belongs to.
    VtepNode
);
string_key!(
    /// A namespace's name.
    NamespaceKey
);

impl From<ProfileId> for ProfileKey {
    fn from(ProfileId { name }: ProfileId) -> Self {
        Self(name)
    }
}

impl ProfileKey {
    /// The proto id of this key.
    pub fn to_proto(&self) -> ProfileId {
        ProfileId {
            name: self.0.clone(),
        }
    }
}

impl From<HostEndpointId> for HostEndpointKey {
    fn from(HostEndpointId { endpoint_id }: HostEndpointId) -> Self {
        Self(endpoint_id)
    }
}

impl HostEndpointKey {
    /// The proto id of this key.
    pub fn to_proto(&self) -> HostEndpointId {
        HostEndpointId {
            endpoint_id: self.0.clone(),
        }
    }
}

impl From<NamespaceId> for NamespaceKey {
    fn from(NamespaceId { name }: NamespaceId) -> Self {
        Self(name)
    }
}

/// A policy's identity. Ordered by kind, namespace, name.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyKey {
    /// The v3 kind, e.g. "GlobalNetworkPolicy".
    pub kind: String,
    /// Empty for a global policy.
    pub namespace: String,
    pub name: String,
}

impl PolicyKey {
    /// The proto id of this key (what the renderer names chains after).
    pub fn to_proto(&self) -> PolicyId {
        PolicyId {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            kind: self.kind.clone(),
        }
    }
}

impl From<PolicyId> for PolicyKey {
    fn from(
        PolicyId {
            name,
            namespace,
            kind,
        }: PolicyId,
    ) -> Self {
        Self {
            kind,
            namespace,
            name,
        }
    }
}

/// The key of a policy an object body refers to (an endpoint's tiers).
impl From<&PolicyId> for PolicyKey {
    fn from(id: &PolicyId) -> Self {
        Self::from(id.clone())
    }
}

/// `<kind>/<name>` for a global policy, `<kind>/<namespace>/<name>` for a namespaced one: the
/// dry-run state file's key and the `/programmed` id.
impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.kind, self.name)
        } else {
            write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
        }
    }
}

/// A workload endpoint's identity: `orchestrator/workload/endpoint`, ordered.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkloadEndpointKey {
    /// e.g. "k8s".
    pub orchestrator_id: String,
    /// e.g. "default/web-0".
    pub workload_id: String,
    /// e.g. "eth0".
    pub endpoint_id: String,
}

impl WorkloadEndpointKey {
    /// The proto id of this key.
    pub fn to_proto(&self) -> WorkloadEndpointId {
        WorkloadEndpointId {
            orchestrator_id: self.orchestrator_id.clone(),
            workload_id: self.workload_id.clone(),
            endpoint_id: self.endpoint_id.clone(),
        }
    }
}

impl From<WorkloadEndpointId> for WorkloadEndpointKey {
    fn from(
        WorkloadEndpointId {
            orchestrator_id,
            workload_id,
            endpoint_id,
        }: WorkloadEndpointId,
    ) -> Self {
        Self {
            orchestrator_id,
            workload_id,
            endpoint_id,
        }
    }
}

impl fmt::Display for WorkloadEndpointKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.orchestrator_id, self.workload_id, self.endpoint_id
        )
    }
}

/// A service account's identity. Ordered by namespace, name.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceAccountKey {
    pub namespace: String,
    pub name: String,
}

impl From<ServiceAccountId> for ServiceAccountKey {
    fn from(ServiceAccountId { namespace, name }: ServiceAccountId) -> Self {
        Self { namespace, name }
    }
}

/// A Kubernetes service's identity. Ordered by namespace, name.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn convert(payload: Payload) -> Result<Received, InvalidMessage> {
        Inbound::try_from(ToDataplane {
            sequence_number: 7,
            payload: Some(payload),
        })
        .map(|i| {
            assert_eq!(i.sequence_number, 7);
            i.received
        })
    }

    fn pid() -> PolicyId {
        PolicyId {
            name: "web".into(),
            namespace: "prod".into(),
            kind: "NetworkPolicy".into(),
        }
    }

    #[test]
    fn valid_messages_carry_typed_keys() {
        let got = convert(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid()),
            policy: Some(Policy::default()),
        }));
        let Ok(Received::Message(Message::PolicyUpdate { key, policy })) = got else {
            panic!("{got:?}")
        };
        assert_eq!(key.to_string(), "NetworkPolicy/prod/web");
        assert_eq!(key.to_proto(), pid());
        assert_eq!(policy, Policy::default());

        let got = convert(Payload::IpsetUpdate(IpSetUpdate {
            id: "s:a".into(),
            members: vec!["10.0.0.1".into()],
            r#type: IpSetType::Net as i32,
        }));
        assert_eq!(
            got,
            Ok(Received::Message(Message::IpSetUpdate {
                id: IpSetId::new("s:a"),
                set_type: IpSetType::Net,
                members: vec!["10.0.0.1".into()],
            }))
        );
        // Keys read in logs exactly as the strings they wrap.
        assert_eq!(format!("{:?}", IpSetId::new("s:\"x\"")), "\"s:\\\"x\\\"\"");
    }

    #[test]
    fn a_message_without_an_id_is_refused_not_default_filled() {
        let cases = [
            (
                Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                    id: None,
                    policy: Some(Policy::default()),
                }),
                "ActivePolicyUpdate",
            ),
            (
                // Every field empty is what proto3 sends for a default-filled id.
                Payload::WorkloadEndpointRemove(WorkloadEndpointRemove {
                    id: Some(WorkloadEndpointId::default()),
                }),
                "WorkloadEndpointRemove",
            ),
            (
                Payload::HostEndpointUpdate(HostEndpointUpdate {
                    id: None,
                    endpoint: Some(HostEndpoint::default()),
                }),
                "HostEndpointUpdate",
            ),
            (
                Payload::IpsetRemove(IpSetRemove { id: String::new() }),
                "IPSetRemove",
            ),
            (
                Payload::ActiveProfileRemove(ActiveProfileRemove { id: None }),
                "ActiveProfileRemove",
            ),
        ];
        for (payload, kind) in cases {
            let err = convert(payload).expect_err(kind);
            assert_eq!(err, InvalidMessage::MissingId { kind });
            assert_eq!(err.kind(), kind);
            assert_eq!(err.key(), None);
            assert_eq!(err.to_string(), format!("{kind} without an id"));
        }
    }

    #[test]
    fn an_update_without_its_object_is_refused_by_key() {
        let err = convert(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(pid()),
            policy: None,
        }))
        .expect_err("no policy");
        assert_eq!(err.key(), Some("\"NetworkPolicy/prod/web\""));
        assert_eq!(
            err.to_string(),
            "ActivePolicyUpdate \"NetworkPolicy/prod/web\" without its policy"
        );
        let err = convert(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: "prod/web-0".into(),
                endpoint_id: "eth0".into(),
            }),
            endpoint: None,
        }))
        .expect_err("no endpoint");
        assert_eq!(err.kind(), "WorkloadEndpointUpdate");
        assert_eq!(err.key(), Some("\"k8s/prod/web-0/eth0\""));
        let err = convert(Payload::IpamPoolUpdate(IpamPoolUpdate {
            id: "10.0.0.0-16".into(),
            pool: None,
        }))
        .expect_err("no pool");
        assert_eq!(err.key(), Some("\"10.0.0.0-16\""));
    }

    #[test]
    fn an_unknown_ip_set_type_is_refused_by_key() {
        let err = convert(Payload::IpsetUpdate(IpSetUpdate {
            id: "s:a".into(),
            members: vec![],
            r#type: 9,
        }))
        .expect_err("type 9");
        assert_eq!(
            err.to_string(),
            "IPSetUpdate \"s:a\": type 9 is not a known value"
        );
    }

    #[test]
    fn a_hostile_key_is_quoted_and_cut_in_the_error() {
        let err = convert(Payload::ActiveProfileUpdate(ActiveProfileUpdate {
            id: Some(ProfileId {
                name: format!("evil\n{}", "x".repeat(500)),
            }),
            profile: None,
        }))
        .expect_err("no profile");
        let key = err.key().expect("key");
        assert!(key.starts_with("\"evil\\n"), "{key}");
        assert!(key.len() <= 80, "{key}");
        assert!(!err.to_string().contains('\n'));
    }

    #[test]
    fn hello_and_unknown_payloads_are_not_driver_messages() {
        let hello = ServerHello {
            node_name: "n1".into(),
            ..Default::default()
        };
        assert_eq!(
            convert(Payload::ServerHello(hello.clone())),
            Ok(Received::ServerHello(hello.clone()))
        );
        assert!(Message::try_from(Payload::ServerHello(hello)).is_err());
        let unknown = Inbound::try_from(ToDataplane {
            sequence_number: 3,
            payload: None,
        })
        .expect("an unknown payload is not an error");
        assert_eq!(unknown.received, Received::Unknown);
        assert_eq!(unknown.received.kind(), "empty payload");
    }

    #[test]
    fn every_payload_converts_and_keeps_its_proto_name() {
        // One of each payload, with ids present: each converts, and `kind` names it as the
        // proto does (the conversion itself is exhaustive by construction: no `_` arm).
        let payloads = vec![
            Payload::InSync(InSync {}),
            Payload::IpsetUpdate(IpSetUpdate {
                id: "s:a".into(),
                ..Default::default()
            }),
            Payload::IpsetDeltaUpdate(IpSetDeltaUpdate {
                id: "s:a".into(),
                ..Default::default()
            }),
            Payload::IpsetRemove(IpSetRemove { id: "s:a".into() }),
            Payload::ActiveProfileUpdate(ActiveProfileUpdate {
                id: Some(ProfileId { name: "p".into() }),
                profile: Some(Profile::default()),
            }),
            Payload::ActiveProfileRemove(ActiveProfileRemove {
                id: Some(ProfileId { name: "p".into() }),
            }),
            Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(pid()),
                policy: Some(Policy::default()),
            }),
            Payload::ActivePolicyRemove(ActivePolicyRemove { id: Some(pid()) }),
            Payload::HostEndpointUpdate(HostEndpointUpdate {
                id: Some(HostEndpointId {
                    endpoint_id: "h".into(),
                }),
                endpoint: Some(HostEndpoint::default()),
            }),
            Payload::HostEndpointRemove(HostEndpointRemove {
                id: Some(HostEndpointId {
                    endpoint_id: "h".into(),
                }),
            }),
            Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
                id: Some(WorkloadEndpointId {
                    endpoint_id: "eth0".into(),
                    ..Default::default()
                }),
                endpoint: Some(WorkloadEndpoint::default()),
            }),
            Payload::WorkloadEndpointRemove(WorkloadEndpointRemove {
                id: Some(WorkloadEndpointId {
                    endpoint_id: "eth0".into(),
                    ..Default::default()
                }),
            }),
            Payload::ConfigUpdate(ConfigUpdate::default()),
            Payload::HostMetadataUpdate(HostMetadataUpdate {
                hostname: "n".into(),
                ..Default::default()
            }),
            Payload::IpamPoolUpdate(IpamPoolUpdate {
                id: "p".into(),
                pool: Some(IpamPool::default()),
            }),
            Payload::IpamPoolRemove(IpamPoolRemove { id: "p".into() }),
            Payload::HostMetadataRemove(HostMetadataRemove {
                hostname: "n".into(),
                ipv4_addr: String::new(),
            }),
            Payload::ServiceAccountUpdate(ServiceAccountUpdate {
                id: Some(ServiceAccountId {
                    namespace: "ns".into(),
                    name: "sa".into(),
                }),
                labels: BTreeMap::new(),
            }),
            Payload::ServiceAccountRemove(ServiceAccountRemove {
                id: Some(ServiceAccountId {
                    namespace: "ns".into(),
                    name: "sa".into(),
                }),
            }),
            Payload::NamespaceUpdate(NamespaceUpdate {
                id: Some(NamespaceId { name: "ns".into() }),
                labels: BTreeMap::new(),
            }),
            Payload::NamespaceRemove(NamespaceRemove {
                id: Some(NamespaceId { name: "ns".into() }),
            }),
            Payload::RouteUpdate(RouteUpdate {
                dst: "10.0.0.0/26".into(),
                ..Default::default()
            }),
            Payload::RouteRemove(RouteRemove {
                dst: "10.0.0.0/26".into(),
            }),
            Payload::VtepUpdate(VxlanTunnelEndpointUpdate {
                node: "n".into(),
                ..Default::default()
            }),
            Payload::VtepRemove(VxlanTunnelEndpointRemove { node: "n".into() }),
            Payload::WireguardEndpointUpdate(WireguardEndpointUpdate {
                hostname: "n".into(),
                ..Default::default()
            }),
            Payload::WireguardEndpointRemove(WireguardEndpointRemove {
                hostname: "n".into(),
            }),
            Payload::GlobalBgpConfigUpdate(GlobalBgpConfigUpdate::default()),
            Payload::Encapsulation(Encapsulation::default()),
            Payload::ServiceUpdate(ServiceUpdate {
                name: "s".into(),
                ..Default::default()
            }),
            Payload::ServiceRemove(ServiceRemove {
                name: "s".into(),
                namespace: String::new(),
            }),
            Payload::WireguardEndpointV6Update(WireguardEndpointV6Update {
                hostname: "n".into(),
                ..Default::default()
            }),
            Payload::WireguardEndpointV6Remove(WireguardEndpointV6Remove {
                hostname: "n".into(),
            }),
        ];
        assert_eq!(payloads.len(), 33, "every payload but ServerHello");
        for p in payloads {
            let proto_name = format!("{p:?}");
            let proto_name = proto_name.split('(').next().unwrap_or_default().to_owned();
            let m = Message::try_from(p).unwrap_or_else(|e| panic!("{proto_name}: {e}"));
            // The Rust variant names drop Calico's capitalisation (Ipset, Vtep, …).
            assert_eq!(
                m.kind().to_ascii_lowercase().replace('_', ""),
                rust_to_proto(&proto_name).to_ascii_lowercase(),
                "{m:?}"
            );
        }
    }

    fn rust_to_proto(variant: &str) -> String {
        match variant {
            "VtepUpdate" => "VXLANTunnelEndpointUpdate".into(),
            "VtepRemove" => "VXLANTunnelEndpointRemove".into(),
            "GlobalBgpConfigUpdate" => "GlobalBGPConfigUpdate".into(),
            other => other.into(),
        }
    }

    fn kpid(kind: &str, name: &str) -> PolicyId {
        PolicyId {
            name: name.into(),
            namespace: String::new(),
            kind: kind.into(),
        }
    }

    #[test]
    fn staged_policies_never_reach_a_driver() {
        for kind in calico_names::STAGED_POLICY_KINDS {
            let got = convert(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
                id: Some(kpid(kind, "trial")),
                policy: Some(Policy::default()),
            }))
            .unwrap();
            assert!(
                matches!(got, Received::Staged(ref k) if k.kind == kind),
                "{got:?}"
            );
            let got = convert(Payload::ActivePolicyRemove(ActivePolicyRemove {
                id: Some(kpid(kind, "trial")),
            }))
            .unwrap();
            assert!(matches!(got, Received::Staged(_)), "{got:?}");
        }
        let enforced = convert(Payload::ActivePolicyUpdate(ActivePolicyUpdate {
            id: Some(kpid("GlobalNetworkPolicy", "real")),
            policy: Some(Policy::default()),
        }))
        .unwrap();
        assert!(matches!(
            enforced,
            Received::Message(Message::PolicyUpdate { .. })
        ));
    }

    #[test]
    fn endpoint_tiers_lose_staged_policies_but_keep_their_tiers() {
        let tier =
            |name: &str, ingress: Vec<PolicyId>, egress: Vec<PolicyId>| felix_proto::TierInfo {
                name: name.into(),
                ingress_policies: ingress,
                egress_policies: egress,
                default_action: "Deny".into(),
            };
        let endpoint = WorkloadEndpoint {
            tiers: vec![
                // Only staged: the tier goes (no end-of-tier drop for it).
                tier(
                    "trial",
                    vec![kpid("StagedGlobalNetworkPolicy", "s")],
                    vec![],
                ),
                // Mixed: the enforced policy stays, in its direction.
                tier(
                    "default",
                    vec![
                        kpid("StagedNetworkPolicy", "s2"),
                        kpid("NetworkPolicy", "a"),
                    ],
                    vec![kpid("StagedKubernetesNetworkPolicy", "knp.default.k")],
                ),
            ],
            ..Default::default()
        };
        let got = convert(Payload::WorkloadEndpointUpdate(WorkloadEndpointUpdate {
            id: Some(WorkloadEndpointId {
                orchestrator_id: "k8s".into(),
                workload_id: "prod/web".into(),
                endpoint_id: "eth0".into(),
            }),
            endpoint: Some(endpoint),
        }))
        .unwrap();
        let Received::Message(Message::WorkloadEndpointUpdate { endpoint, .. }) = got else {
            panic!("{got:?}")
        };
        assert_eq!(
            endpoint.tiers,
            vec![
                tier("trial", vec![], vec![]),
                tier("default", vec![kpid("NetworkPolicy", "a")], vec![])
            ]
        );
        let hep = HostEndpoint {
            forward_tiers: vec![tier(
                "trial",
                vec![],
                vec![kpid("StagedGlobalNetworkPolicy", "f")],
            )],
            untracked_tiers: vec![tier(
                "trial",
                vec![kpid("StagedGlobalNetworkPolicy", "u")],
                vec![],
            )],
            ..Default::default()
        };
        let got = convert(Payload::HostEndpointUpdate(HostEndpointUpdate {
            id: Some(HostEndpointId {
                endpoint_id: "eth0".into(),
            }),
            endpoint: Some(hep),
        }))
        .unwrap();
        let Received::Message(Message::HostEndpointUpdate { endpoint, .. }) = got else {
            panic!("{got:?}")
        };
        // Forward tiers stay: Felix's allow-by-default forward chain is for hosts with none.
        assert_eq!(endpoint.forward_tiers, vec![tier("trial", vec![], vec![])]);
        assert_eq!(
            endpoint.untracked_tiers,
            vec![tier("trial", vec![], vec![])]
        );
    }
}
