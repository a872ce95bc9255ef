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
//! The adapter is thin (architecture invariant 2): it produces the same v3 resources the etcd and
//! file adapters do, so the graph cannot tell which datastore it runs on.

pub mod watcher;

use anyhow::Context;
pub use calc_ingest::kubernetes::Source;
use common::Tasks;
use kube::core::ApiResource;

use super::{Health, Sink};
use crate::args::{KubeArgs, ServeArgs};

/// Starts the watcher (into `sink`); fails on a missing or broken configuration, while an
/// unreachable API server is retried by the watchers.
pub(super) async fn start(
    args: &ServeArgs,
    health: Health,
    sink: Sink,
    tasks: &Tasks,
) -> anyhow::Result<String> {
    let client = client(&args.datastore.kube).await?;
    let watcher = watcher::Watcher::new(
        watcher::WatchConfig {
            args: args.datastore.kube.clone(),
            resync_interval: args.kube.kube_resync_interval,
        },
        sink,
        health,
        tasks.clone(),
    );
    tasks.spawn(
        tracing::info_span!("datastore", "type" = "kubernetes"),
        watcher.run(client),
    );
    Ok("the Kubernetes API".into())
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
        let r = api_resource(Source::NetworkPolicyApi(Kind::ClusterNetworkPolicy));
        assert_eq!(
            (r.group.as_str(), r.version.as_str(), r.plural.as_str()),
            (
                "policy.networking.k8s.io",
                "v1alpha2",
                "clusternetworkpolicies"
            )
        );
        let r = api_resource(Source::NetworkPolicyApi(Kind::AdminNetworkPolicy));
        assert_eq!(r.api_version, "policy.networking.k8s.io/v1alpha1");
    }

    /// The shipped ClusterRole must grant list and watch on every collection the adapter
    /// watches: a missing one is a 403 that keeps the server out of sync.
    #[test]
    fn the_shipped_rbac_covers_every_watched_collection() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docker/k8s/calc-server-rbac.yaml"
        );
        let text = std::fs::read_to_string(path).expect("read the RBAC manifest");
        // Our own manifest's shape: `- apiGroups: ["g"]`, then `resources:` items, then verbs.
        let mut granted: Vec<(String, String)> = Vec::new();
        let mut pending: Vec<(String, String)> = Vec::new();
        let mut group = None;
        for line in text.lines().map(str::trim) {
            if let Some(g) = line.strip_prefix("- apiGroups: [") {
                group = Some(g.trim_end_matches(']').trim_matches('"').to_string());
            } else if let (Some(g), Some(list)) = (&group, line.strip_prefix("resources: [")) {
                for res in list.trim_end_matches(']').split(',') {
                    pending.push((g.clone(), res.trim().trim_matches('"').to_string()));
                }
            } else if let (Some(g), Some(res)) = (&group, line.strip_prefix("- ")) {
                pending.push((g.clone(), res.to_string()));
            } else if line.starts_with("verbs:") {
                // Only a rule that may list and watch counts for a watched collection.
                if line.contains("\"list\"") && line.contains("\"watch\"") {
                    granted.append(&mut pending);
                }
                pending.clear();
                group = None;
            }
        }
        for source in Source::ALL {
            let c = source.collection();
            assert!(
                granted.iter().any(|(g, r)| g == c.group && r == c.plural),
                "{path} does not grant list/watch on {source}"
            );
        }
        // The hit counters' ConfigMaps: in the server's namespace only, never cluster-wide.
        assert!(
            text.contains("kind: Role\n")
                && text.contains("resources: [\"configmaps\"]")
                && text.contains("verbs: [\"list\", \"create\", \"patch\", \"delete\"]"),
            "{path} grants the hit counters' ConfigMaps"
        );
    }
}
