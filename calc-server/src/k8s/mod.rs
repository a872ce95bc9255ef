//! The Kubernetes datastore: Calico's CRDs (`crd.projectcalico.org/v1`) and the native objects
//! Calico's Kubernetes datastore derives policy data from, read with the kube client's list/watch.
//!
//! - [`convert`]: one object of one watched [`Source`] → a graph resource, a skip, or a rejection
//!   naming the object, exactly as Calico's Kubernetes backend converts it (pods → workload
//!   endpoints, namespaces and service accounts → profiles, Kubernetes NetworkPolicy → a
//!   `knp.default.` NetworkPolicy, nodes → Node, CRDs → the v3 object they carry). Pure.
//! - [`mirror`]: what was last delivered per watched object, so that every (re-)list of a source
//!   becomes exactly the `Apply`/`Delete` updates that reconcile the graph (mark and sweep per
//!   source). Pure.
//! - [`watcher`]: the IO: one kube-runtime watcher per source (list at a resourceVersion, watch
//!   with bookmarks, re-list on 410 Gone, back-off on errors), merged into one update stream;
//!   also the one-shot snapshot `compute` uses.
//!
//! The adapter is thin (DESIGN.md invariant 2): it produces the same v3 resources the etcd and
//! file adapters do, so the graph cannot tell which datastore it runs on.

pub mod convert;
pub mod mirror;
pub mod watcher;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use calc_graph::model::Kind;
use kube::core::ApiResource;

use crate::serve::parse_duration;

/// The API group of Calico's CRDs.
pub const CRD_GROUP: &str = "crd.projectcalico.org";

/// Connection flags shared by `serve` and `compute` (flattened into `DatastoreArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct KubeArgs {
    /// Kubeconfig file for `--datastore-type kubernetes`. Without it the client is configured
    /// as kubectl would be: $KUBECONFIG, then ~/.kube/config, then the in-cluster service
    /// account.
    #[arg(long, env = "CALC_SERVER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the kubeconfig to use (default: its current context).
    #[arg(long, env = "CALC_SERVER_KUBE_CONTEXT")]
    pub kube_context: Option<String>,
    /// Prefix of the host-side interface names of pods (Felix's InterfacePrefix; the first of a
    /// comma-separated list is used, as Calico's CNI plugin does).
    #[arg(long, env = "FELIX_INTERFACEPREFIX", default_value = "cali")]
    pub interface_prefix: String,
}

/// Flags only `serve` needs (flattened into `ServeArgs`).
#[derive(Clone, Debug, clap::Args)]
pub struct KubeServeArgs {
    /// Anti-entropy: re-list every source this often and reconcile (only differences are
    /// sent; 0 disables). Watches already re-list on 410 Gone and after errors.
    #[arg(long, env = "CALC_SERVER_KUBE_RESYNC_INTERVAL", default_value = "30m", value_parser = parse_duration)]
    pub kube_resync_interval: Duration,
}

impl KubeArgs {
    /// The interface prefix in force (first entry of the list).
    pub fn interface_prefix(&self) -> String {
        self.interface_prefix
            .split(',')
            .map(str::trim)
            .find(|p| !p.is_empty())
            .unwrap_or("cali")
            .to_string()
    }
}

/// A kube client for `args`. Fails on unreadable or invalid configuration; an unreachable API
/// server shows up as errors of the first requests.
pub async fn client(args: &KubeArgs) -> anyhow::Result<kube::Client> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            let options = kube::config::KubeConfigOptions {
                context: args.kube_context.clone(),
                ..Default::default()
            };
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .with_context(|| format!("loading --kubeconfig {}", path.display()))?
        }
        None if args.kube_context.is_some() => {
            let options = kube::config::KubeConfigOptions {
                context: args.kube_context.clone(),
                ..Default::default()
            };
            kube::Config::from_kubeconfig(&options)
                .await
                .context("loading the kubeconfig")?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration found (kubeconfig or in-cluster)")?,
    };
    let url = config.cluster_url.to_string();
    kube::Client::try_from(config).with_context(|| format!("creating a client for {url}"))
}

/// One watched collection: a Calico CRD or a native Kubernetes kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// A Calico CRD whose spec is the v3 spec of this kind.
    Crd(Kind),
    Pod,
    Namespace,
    ServiceAccount,
    Node,
    /// `networking.k8s.io/v1` NetworkPolicy.
    KubernetesNetworkPolicy,
}

impl Source {
    /// Every source the adapter watches.
    pub const ALL: [Source; 14] = [
        Source::Crd(Kind::Tier),
        Source::Crd(Kind::GlobalNetworkPolicy),
        Source::Crd(Kind::NetworkPolicy),
        Source::Crd(Kind::GlobalNetworkSet),
        Source::Crd(Kind::NetworkSet),
        Source::Crd(Kind::HostEndpoint),
        Source::Crd(Kind::IPPool),
        Source::Crd(Kind::FelixConfiguration),
        Source::Crd(Kind::ClusterInformation),
        Source::Namespace,
        Source::ServiceAccount,
        Source::Node,
        Source::KubernetesNetworkPolicy,
        Source::Pod,
    ];

    /// Whether objects of this source live in a namespace.
    pub fn namespaced(self) -> bool {
        match self {
            Source::Crd(kind) => kind.namespaced(),
            Source::Pod | Source::ServiceAccount | Source::KubernetesNetworkPolicy => true,
            Source::Namespace | Source::Node => false,
        }
    }

    /// Group, version, kind and plural, for the dynamic API.
    pub fn api_resource(self) -> ApiResource {
        let (group, version, kind, plural) = match self {
            Source::Crd(kind) => (CRD_GROUP, "v1", kind.as_str(), kind.plural()),
            Source::Pod => ("", "v1", "Pod", "pods"),
            Source::Namespace => ("", "v1", "Namespace", "namespaces"),
            Source::ServiceAccount => ("", "v1", "ServiceAccount", "serviceaccounts"),
            Source::Node => ("", "v1", "Node", "nodes"),
            Source::KubernetesNetworkPolicy => (
                "networking.k8s.io",
                "v1",
                "NetworkPolicy",
                "networkpolicies",
            ),
        };
        ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: if group.is_empty() {
                version.into()
            } else {
                format!("{group}/{version}")
            },
            kind: kind.into(),
            plural: plural.into(),
        }
    }

    /// `<plural>.<group>` (or the plural alone for the core group), as kubectl names it.
    pub fn name(self) -> String {
        let r = self.api_resource();
        if r.group.is_empty() {
            r.plural
        } else {
            format!("{}.{}", r.plural, r.group)
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_name_their_collections() {
        assert_eq!(Source::Pod.name(), "pods");
        assert_eq!(
            Source::KubernetesNetworkPolicy.name(),
            "networkpolicies.networking.k8s.io"
        );
        assert_eq!(
            Source::Crd(Kind::GlobalNetworkPolicy).name(),
            "globalnetworkpolicies.crd.projectcalico.org"
        );
        let r = Source::Crd(Kind::Tier).api_resource();
        assert_eq!(r.api_version, "crd.projectcalico.org/v1");
        assert_eq!(Source::Node.api_resource().api_version, "v1");
        assert!(Source::Crd(Kind::NetworkSet).namespaced());
        assert!(!Source::Crd(Kind::Tier).namespaced());
    }

    #[test]
    fn interface_prefix_takes_the_first_entry() {
        let args = KubeArgs {
            kubeconfig: None,
            kube_context: None,
            interface_prefix: " eni , veth".into(),
        };
        assert_eq!(args.interface_prefix(), "eni");
    }
}
