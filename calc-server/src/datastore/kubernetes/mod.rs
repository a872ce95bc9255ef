//! The Kubernetes datastore: Calico's CRDs (`crd.projectcalico.org/v1`) and the native objects
//! Calico's Kubernetes datastore derives policy data from, read with the kube client's list/watch.
//!
//! Which collections are watched, how each object converts (pods → workload endpoints,
//! namespaces and service accounts → profiles, Kubernetes NetworkPolicy → a `knp.default.`
//! NetworkPolicy, nodes → Node, CRDs → the v3 object they carry) and how a re-list reconciles
//! (mark and sweep per source) are pure and live in `calc_ingest::kubernetes` and
//! `calc_ingest::mirror`; this module is the IO:
//! - [`watcher`]: the IO: one kube-runtime watcher per source (list at a resourceVersion, watch
//!   with bookmarks, re-list on 410 Gone, back-off on errors), merged into one update stream;
//!   also the one-shot snapshot `compute` uses.
//!
//! The adapter is thin (DESIGN.md invariant 2): it produces the same v3 resources the etcd and
//! file adapters do, so the graph cannot tell which datastore it runs on.

pub mod watcher;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
pub use calc_ingest::kubernetes::Source;
use kube::core::ApiResource;

use crate::serve::parse_duration;

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

/// The kube client's description of `source`'s collection.
pub fn api_resource(source: Source) -> ApiResource {
    let c = source.collection();
    ApiResource {
        group: c.group.into(),
        version: c.version.into(),
        api_version: c.api_version(),
        kind: c.kind.into(),
        plural: c.plural.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_resources_carry_the_collection() {
        use calc_graph::model::Kind;
        let r = api_resource(Source::Crd(Kind::Tier));
        assert_eq!(r.api_version, "crd.projectcalico.org/v1");
        assert_eq!((r.kind.as_str(), r.plural.as_str()), ("Tier", "tiers"));
        let r = api_resource(Source::KubernetesNetworkPolicy);
        assert_eq!(r.group, "networking.k8s.io");
        assert_eq!(api_resource(Source::Node).api_version, "v1");
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
