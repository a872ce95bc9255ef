//! An in-process fake Kubernetes API server for the Kubernetes datastore tests.
//!
//! No kube-apiserver binary can be installed here, so the tests run the real kube client (inside
//! the real `calc-server`) against this server, which speaks the API's list/watch protocol over
//! HTTP/1.1 with the API's JSON:
//! - `GET <collection>`: a `<Kind>List` with `metadata.resourceVersion` (the store's current
//!   revision); items carry their own `resourceVersion` (the revision of their last change).
//!   Native kinds' items have no `kind`/`apiVersion`, as the real server sends them.
//! - `GET <collection>?watch=true&resourceVersion=R[&allowWatchBookmarks=true]`: newline-
//!   delimited watch events (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`) for every change after
//!   R, then live ones, until `timeoutSeconds`. A watch from a revision older than the last
//!   [`FakeKube::expire`] gets an `ERROR` event carrying a 410 `Status` (reason `Expired`), as
//!   the real server does when its watch cache no longer holds R; `expire` also ends every open
//!   watch that way, which forces the client to re-list.
//! - a collection that is not served answers 404 with a `Status` (a CRD not installed).
//!
//! - namespaced ConfigMaps (what the hit counters' store uses), `/api/v1/namespaces/{ns}/configmaps`:
//!   LIST (with an equality `labelSelector`), GET of one, server-side apply PATCH (content type
//!   `application/apply-patch+yaml`, `fieldManager` required, the body's `apiVersion`/`kind`
//!   required and its name matching the URL's, as the real server checks) that creates (201)
//!   or replaces (200) the object, and DELETE (200, 404 when missing). No watch. The test
//!   reads and writes them directly ([`FakeKube::config_maps`], [`FakeKube::put_config_map`],
//!   …) and can make every ConfigMap request fail ([`FakeKube::fail_config_maps`]).
//!
//! Otherwise only cluster-wide collections are served (what the adapter uses). Changes made with
//! [`FakeKube::apply_silently`] / [`FakeKube::delete_silently`] produce no watch event: they
//! stand for events lost while a watch was expired, which only a re-list can recover.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, Method, Response, StatusCode, Uri};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

/// Collections of the native kinds the adapter watches.
pub const PODS: &str = "/api/v1/pods";
pub const NAMESPACES: &str = "/api/v1/namespaces";
pub const SERVICE_ACCOUNTS: &str = "/api/v1/serviceaccounts";
pub const NODES: &str = "/api/v1/nodes";
pub const NETWORK_POLICIES: &str = "/apis/networking.k8s.io/v1/networkpolicies";
pub const ENDPOINT_SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
pub const SERVICES: &str = "/api/v1/services";

/// Collections of the network-policy-api kinds (served only after [`FakeKube::serve`]).
pub const CLUSTER_NETWORK_POLICIES: &str =
    "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";
pub const ADMIN_NETWORK_POLICIES: &str =
    "/apis/policy.networking.k8s.io/v1alpha1/adminnetworkpolicies";

/// The collection of a Calico CRD (`tiers`, `globalnetworkpolicies`, …).
pub fn crd(plural: &str) -> String {
    format!("/apis/crd.projectcalico.org/v1/{plural}")
}

/// Every Calico CRD the adapter watches, by plural and kind.
pub const CRDS: [(&str, &str); 9] = [
    ("networkpolicies", "NetworkPolicy"),
    ("globalnetworkpolicies", "GlobalNetworkPolicy"),
    ("tiers", "Tier"),
    ("networksets", "NetworkSet"),
    ("globalnetworksets", "GlobalNetworkSet"),
    ("hostendpoints", "HostEndpoint"),
    ("ippools", "IPPool"),
    ("felixconfigurations", "FelixConfiguration"),
    ("clusterinformations", "ClusterInformation"),
];

#[derive(Clone, Debug)]
enum Broadcast {
    Event {
        rv: u64,
        path: String,
        kind: &'static str,
        object: Value,
    },
    Bookmark,
    Expire,
}

struct Collection {
    api_version: String,
    kind: String,
    /// Whether list items carry kind/apiVersion (custom resources do, native ones do not).
    typed_items: bool,
    objects: BTreeMap<String, Value>,
}

struct Store {
    rv: u64,
    collections: HashMap<String, Collection>,
    log: Vec<Broadcast>,
    /// Watches from below this revision are answered with 410.
    expired_below: u64,
    lists: HashMap<String, usize>,
    watches: HashMap<String, usize>,
    /// ConfigMaps by (namespace, name).
    config_maps: BTreeMap<(String, String), Value>,
    /// Every ConfigMap request answers this status while set.
    config_maps_fail: Option<u16>,
    config_map_requests: ConfigMapRequests,
    /// Each ConfigMap's successive states written through the API (`None`: deleted).
    config_map_history: BTreeMap<(String, String), Vec<Option<Value>>>,
}

/// The ConfigMap requests served, by verb (`failed`: answered with the
/// [`FakeKube::fail_config_maps`] status, counted apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConfigMapRequests {
    pub lists: usize,
    pub gets: usize,
    pub applies: usize,
    pub deletes: usize,
    pub failed: usize,
}

type Shared = Arc<(Mutex<Store>, broadcast::Sender<Broadcast>)>;

/// A running fake API server; it serves until the test process ends.
pub struct FakeKube {
    pub url: String,
    shared: Shared,
}

fn key_of(object: &Value) -> String {
    let meta = &object["metadata"];
    let name = meta["name"].as_str().expect("object has metadata.name");
    match meta["namespace"].as_str() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

impl FakeKube {
    /// Serves the native collections and the Calico CRDs whose plurals are in `crds` (the
    /// others answer 404, as for a CRD that is not installed).
    pub fn start(crds: &[&str]) -> FakeKube {
        let mut collections = HashMap::new();
        for (path, api_version, kind) in [
            (PODS, "v1", "Pod"),
            (NAMESPACES, "v1", "Namespace"),
            (SERVICE_ACCOUNTS, "v1", "ServiceAccount"),
            (NODES, "v1", "Node"),
            (NETWORK_POLICIES, "networking.k8s.io/v1", "NetworkPolicy"),
            (ENDPOINT_SLICES, "discovery.k8s.io/v1", "EndpointSlice"),
            (SERVICES, "v1", "Service"),
        ] {
            collections.insert(
                path.to_string(),
                Collection {
                    api_version: api_version.into(),
                    kind: kind.into(),
                    typed_items: false,
                    objects: BTreeMap::new(),
                },
            );
        }
        for (plural, kind) in CRDS {
            if crds.contains(&plural) {
                collections.insert(
                    crd(plural),
                    Collection {
                        api_version: "crd.projectcalico.org/v1".into(),
                        kind: kind.into(),
                        typed_items: true,
                        objects: BTreeMap::new(),
                    },
                );
            }
        }
        let (tx, _) = broadcast::channel(4096);
        let shared: Shared = Arc::new((
            Mutex::new(Store {
                rv: 100,
                collections,
                log: Vec::new(),
                expired_below: 0,
                lists: HashMap::new(),
                watches: HashMap::new(),
                config_maps: BTreeMap::new(),
                config_maps_fail: None,
                config_map_requests: ConfigMapRequests::default(),
                config_map_history: BTreeMap::new(),
            }),
            tx,
        ));
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").expect("bind the fake API server");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        // A runtime of its own on its own thread, so sync and async tests can both use it (a
        // runtime can neither be started nor dropped inside another).
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("fake API server runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let _ = axum::serve(listener, app).await;
            });
        });
        FakeKube { url, shared }
    }

    /// Starts serving a custom resource collection (as when its CRD is installed): `path` is
    /// `/apis/<group>/<version>/<plural>`, whose items carry `kind` and `apiVersion`.
    pub fn serve(&self, path: &str, kind: &str) {
        let api_version = path
            .strip_prefix("/apis/")
            .and_then(|p| p.rsplit_once('/'))
            .map(|(gv, _)| gv.to_string())
            .expect("a /apis/<group>/<version>/<plural> path");
        self.shared.0.lock().collections.insert(
            path.to_string(),
            Collection {
                api_version,
                kind: kind.into(),
                typed_items: true,
                objects: BTreeMap::new(),
            },
        );
    }

    /// Writes a kubeconfig pointing at this server into `dir`; returns its path.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig.yaml");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\nusers:\n- name: tester\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: tester\ncurrent-context: fake\n",
            self.url
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    fn change(&self, path: &str, object: Option<Value>, delete: Option<&str>, silent: bool) {
        let (store, tx) = &*self.shared;
        let mut s = store.lock();
        s.rv += 1;
        let rv = s.rv;
        let coll = s
            .collections
            .get_mut(path)
            .unwrap_or_else(|| panic!("{path} is not served"));
        let event = match (object, delete) {
            (Some(mut obj), _) => {
                obj["metadata"]["resourceVersion"] = rv.to_string().into();
                if obj["metadata"].get("uid").is_none() {
                    obj["metadata"]["uid"] = format!("uid-{}", key_of(&obj)).into();
                }
                let key = key_of(&obj);
                let kind = if coll.objects.contains_key(&key) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                coll.objects.insert(key, obj.clone());
                Some((kind, obj))
            }
            (None, Some(key)) => coll.objects.remove(key).map(|mut obj| {
                obj["metadata"]["resourceVersion"] = rv.to_string().into();
                ("DELETED", obj)
            }),
            (None, None) => None,
        };
        if silent {
            return;
        }
        if let Some((kind, object)) = event {
            let ev = Broadcast::Event {
                rv,
                path: path.to_string(),
                kind,
                object,
            };
            s.log.push(ev.clone());
            let _ = tx.send(ev);
        }
    }

    /// Creates or replaces an object (ADDED or MODIFIED to watchers).
    pub fn apply(&self, path: &str, object: Value) {
        self.change(path, Some(object), None, false);
    }

    /// Deletes `namespace/name` (or `name`) (DELETED to watchers).
    pub fn delete(&self, path: &str, key: &str) {
        self.change(path, None, Some(key), false);
    }

    /// Creates or replaces an object without telling any watcher.
    pub fn apply_silently(&self, path: &str, object: Value) {
        self.change(path, Some(object), None, true);
    }

    /// Deletes an object without telling any watcher.
    pub fn delete_silently(&self, path: &str, key: &str) {
        self.change(path, None, Some(key), true);
    }

    /// Sends a BOOKMARK at the current revision to every watch that asked for bookmarks.
    pub fn bookmark(&self) {
        let _ = self.shared.1.send(Broadcast::Bookmark);
    }

    /// Forgets the watch history: every open watch ends with a 410 `Expired` error, and so does
    /// any watch from an older revision, so clients must list again.
    pub fn expire(&self) {
        let (store, tx) = &*self.shared;
        let mut s = store.lock();
        s.expired_below = s.rv + 1;
        s.log.clear();
        let _ = tx.send(Broadcast::Expire);
    }

    /// How many lists / watches of `path` were served.
    pub fn lists(&self, path: &str) -> usize {
        let s = self.shared.0.lock();
        s.lists.get(path).copied().unwrap_or(0)
    }

    pub fn watches(&self, path: &str) -> usize {
        let s = self.shared.0.lock();
        s.watches.get(path).copied().unwrap_or(0)
    }

    /// The ConfigMaps of `namespace` as the API stores them (with `resourceVersion`, `uid`,
    /// `creationTimestamp`), by name.
    pub fn config_maps(&self, namespace: &str) -> Vec<Value> {
        let s = self.shared.0.lock();
        s.config_maps
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// One ConfigMap, if it exists.
    pub fn config_map(&self, namespace: &str, name: &str) -> Option<Value> {
        let s = self.shared.0.lock();
        s.config_maps
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Creates or replaces a ConfigMap in `namespace` (its `metadata.name` names it), as
    /// `kubectl apply` would; not recorded in [`FakeKube::config_map_history`].
    pub fn put_config_map(&self, namespace: &str, object: Value) {
        let mut s = self.shared.0.lock();
        store_config_map(&mut s, namespace, &object);
    }

    /// Deletes a ConfigMap; whether it existed.
    pub fn delete_config_map(&self, namespace: &str, name: &str) -> bool {
        let mut s = self.shared.0.lock();
        s.config_maps
            .remove(&(namespace.to_string(), name.to_string()))
            .is_some()
    }

    /// While `Some(code)` (500, 503, …), every ConfigMap request is answered with that status
    /// and changes nothing, as an API server whose storage is unreachable; `None` restores them.
    pub fn fail_config_maps(&self, code: Option<u16>) {
        self.shared.0.lock().config_maps_fail = code;
    }

    /// The ConfigMap requests served so far.
    pub fn config_map_requests(&self) -> ConfigMapRequests {
        self.shared.0.lock().config_map_requests
    }

    /// Every state a ConfigMap was given through the API (apply: the stored object; delete:
    /// `None`), oldest first.
    pub fn config_map_history(&self, namespace: &str, name: &str) -> Vec<Option<Value>> {
        let s = self.shared.0.lock();
        s.config_map_history
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
            .unwrap_or_default()
    }
}

/// Stores `object` as ConfigMap `namespace/<metadata.name>`, keeping what the API keeps
/// (`metadata.name/namespace/labels/annotations`, `data`, `binaryData`) and setting
/// `resourceVersion`, `uid` and `creationTimestamp` (kept from the object it replaces). Returns
/// the stored object and whether it was created.
fn store_config_map(s: &mut Store, namespace: &str, object: &Value) -> (Value, bool) {
    let name = object["metadata"]["name"]
        .as_str()
        .expect("a ConfigMap has metadata.name")
        .to_string();
    s.rv += 1;
    let key = (namespace.to_string(), name.clone());
    let previous = s.config_maps.get(&key);
    let created = previous.is_none();
    let (uid, created_at) = match previous {
        Some(p) => (
            p["metadata"]["uid"].clone(),
            p["metadata"]["creationTimestamp"].clone(),
        ),
        None => (
            format!("uid-configmap-{namespace}-{name}-{}", s.rv).into(),
            now_rfc3339().into(),
        ),
    };
    let mut meta = json!({"name": name, "namespace": namespace,
                          "resourceVersion": s.rv.to_string(), "uid": uid,
                          "creationTimestamp": created_at});
    for field in ["labels", "annotations"] {
        if let Some(v) = object["metadata"].get(field).filter(|v| !v.is_null()) {
            meta[field] = v.clone();
        }
    }
    let mut stored = json!({"metadata": meta});
    for field in ["data", "binaryData"] {
        if let Some(v) = object.get(field).filter(|v| !v.is_null()) {
            stored[field] = v.clone();
        }
    }
    s.config_maps.insert(key, stored.clone());
    (stored, created)
}

/// The current time as the API writes it (`2006-01-02T15:04:05Z`).
fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `%XX` and `+` decoded (a query value).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `labels` satisfy a label selector of comma-separated `k=v`, `k==v`, `k!=v`, `k`
/// and `!k` terms (set-based `in`/`notin` are not supported: `Err`, answered with a 400).
fn selector_matches(selector: &str, labels: &Value) -> Result<bool, String> {
    let get = |k: &str| labels.get(k).and_then(Value::as_str);
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let ok = if let Some((k, v)) = term.split_once("!=") {
            get(k.trim()) != Some(v.trim())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            get(k.trim()) == Some(v.trim())
        } else if term.contains(' ') || term.contains('(') {
            return Err(format!("unsupported label selector term {term:?}"));
        } else if let Some(k) = term.strip_prefix('!') {
            get(k).is_none()
        } else {
            get(term).is_some()
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `/api/v1/namespaces/{ns}/configmaps[/{name}]` → (ns, name).
fn config_map_path(path: &str) -> Option<(String, Option<String>)> {
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let mut parts = rest.split('/');
    let ns = parts.next().filter(|n| !n.is_empty())?;
    if parts.next()? != "configmaps" {
        return None;
    }
    let name = parts.next().map(str::to_string);
    if parts.next().is_some() {
        return None;
    }
    Some((ns.to_string(), name))
}

fn with_type(mut object: Value) -> Value {
    object["apiVersion"] = "v1".into();
    object["kind"] = "ConfigMap".into();
    object
}

fn handle_config_maps(
    shared: &Shared,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    ns: &str,
    name: Option<&str>,
) -> Response<Body> {
    let q = query(uri);
    let mut s = shared.0.lock();
    if let Some(code) = s.config_maps_fail {
        s.config_map_requests.failed += 1;
        let code = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        return json_response(
            code,
            &status(
                code.as_u16(),
                code.canonical_reason().unwrap_or("Unavailable"),
                "storage is unreachable (FakeKube::fail_config_maps)",
            ),
        );
    }
    let bad = |message: String| {
        json_response(
            StatusCode::BAD_REQUEST,
            &status(400, "BadRequest", &message),
        )
    };
    let not_found = |name: &str| {
        json_response(
            StatusCode::NOT_FOUND,
            &status(404, "NotFound", &format!("configmaps \"{name}\" not found")),
        )
    };
    match (method, name) {
        (&Method::GET, None) => {
            if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
                return json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &status(
                        405,
                        "MethodNotAllowed",
                        "the fake does not watch ConfigMaps",
                    ),
                );
            }
            let selector = q
                .get("labelSelector")
                .map(|v| percent_decode(v))
                .unwrap_or_default();
            let mut items = Vec::new();
            for ((n, _), object) in &s.config_maps {
                if n != ns {
                    continue;
                }
                match selector_matches(&selector, &object["metadata"]["labels"]) {
                    Ok(true) => items.push(object.clone()),
                    Ok(false) => {}
                    Err(message) => return bad(message),
                }
            }
            s.config_map_requests.lists += 1;
            json_response(
                StatusCode::OK,
                &json!({"apiVersion": "v1", "kind": "ConfigMapList",
                        "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
            )
        }
        (&Method::GET, Some(name)) => {
            s.config_map_requests.gets += 1;
            match s.config_maps.get(&(ns.to_string(), name.to_string())) {
                Some(object) => json_response(StatusCode::OK, &with_type(object.clone())),
                None => not_found(name),
            }
        }
        (&Method::PATCH, Some(name)) => {
            let content_type = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if content_type.split(';').next().map(str::trim) != Some("application/apply-patch+yaml")
            {
                return json_response(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    &status(
                        415,
                        "UnsupportedMediaType",
                        &format!("the fake serves only server-side apply, not {content_type:?}"),
                    ),
                );
            }
            if q.get("fieldManager").is_none_or(|m| m.is_empty()) {
                return bad("PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch".into());
            }
            let text = String::from_utf8_lossy(body);
            let object: Value = match serde_json::from_str(&text)
                .or_else(|_| serde_saphyr::from_str::<Value>(&text).map_err(|e| e.to_string()))
            {
                Ok(v) => v,
                Err(e) => return bad(format!("error decoding YAML: {e}")),
            };
            if object["apiVersion"] != "v1" || object["kind"] != "ConfigMap" {
                return bad(format!(
                    "invalid object type: apiVersion {} kind {} (an apply body must say v1 ConfigMap)",
                    object["apiVersion"], object["kind"]
                ));
            }
            if object["metadata"]["name"] != name {
                return bad(format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    object["metadata"]["name"]
                ));
            }
            if let Some(body_ns) = object["metadata"]["namespace"].as_str()
                && body_ns != ns
            {
                return bad(format!(
                    "the namespace of the object ({body_ns}) does not match the namespace on the URL ({ns})"
                ));
            }
            s.config_map_requests.applies += 1;
            let (stored, created) = store_config_map(&mut s, ns, &object);
            s.config_map_history
                .entry((ns.to_string(), name.to_string()))
                .or_default()
                .push(Some(stored.clone()));
            let code = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            json_response(code, &with_type(stored))
        }
        (&Method::DELETE, Some(name)) => {
            s.config_map_requests.deletes += 1;
            match s.config_maps.remove(&(ns.to_string(), name.to_string())) {
                Some(_) => {
                    s.rv += 1;
                    s.config_map_history
                        .entry((ns.to_string(), name.to_string()))
                        .or_default()
                        .push(None);
                    json_response(
                        StatusCode::OK,
                        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                "status": "Success",
                                "details": {"name": name, "kind": "configmaps"}}),
                    )
                }
                None => not_found(name),
            }
        }
        _ => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &status(
                405,
                "MethodNotAllowed",
                &format!("the fake does not serve {method} here"),
            ),
        ),
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("response")
}

fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn handle(
    AxumState(shared): AxumState<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let path = uri.path().trim_end_matches('/').to_string();
    if let Some((ns, name)) = config_map_path(&path) {
        return handle_config_maps(
            &shared,
            &method,
            &uri,
            &headers,
            &body,
            &ns,
            name.as_deref(),
        );
    }
    let q = query(&uri);
    let watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let (store, tx) = &*shared;
    let mut s = store.lock();
    let Some(coll) = s.collections.get(&path) else {
        return json_response(
            StatusCode::NOT_FOUND,
            &status(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    let (api_version, kind, typed) = (
        coll.api_version.clone(),
        coll.kind.clone(),
        coll.typed_items,
    );
    if !watch {
        let items: Vec<Value> = coll
            .objects
            .values()
            .map(|o| {
                let mut o = o.clone();
                if typed {
                    o["apiVersion"] = api_version.clone().into();
                    o["kind"] = kind.clone().into();
                } else if let Some(m) = o.as_object_mut() {
                    m.remove("apiVersion");
                    m.remove("kind");
                }
                o
            })
            .collect();
        let body = json!({"apiVersion": api_version, "kind": format!("{kind}List"),
                          "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
        *s.lists.entry(path).or_default() += 1;
        return json_response(StatusCode::OK, &body);
    }
    *s.watches.entry(path.clone()).or_default() += 1;
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(s.rv);
    let bookmarks = q.get("allowWatchBookmarks").is_some_and(|v| v == "true");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(290u64);
    let (out_tx, out_rx) = mpsc::channel::<Result<String, std::io::Error>>(1024);
    let line = |v: Value| Ok(format!("{v}\n"));
    let gone =
        json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")});
    let mut live = tx.subscribe();
    let mut backlog = Vec::new();
    let expired = from < s.expired_below;
    if !expired {
        for ev in &s.log {
            if let Broadcast::Event {
                rv,
                path: p,
                kind,
                object,
            } = ev
                && *p == path
                && *rv > from
            {
                backlog.push(json!({"type": kind, "object": object}));
            }
        }
    }
    let last_sent = s.rv.max(from);
    drop(s);
    let shared_for_task = shared.clone();
    tokio::spawn(async move {
        if expired {
            let _ = out_tx.send(line(gone)).await;
            return;
        }
        for ev in backlog {
            if out_tx.send(line(ev)).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        loop {
            let msg = tokio::select! {
                m = live.recv() => m,
                () = tokio::time::sleep_until(deadline) => return,
            };
            let ev = match msg {
                Ok(Broadcast::Event {
                    rv,
                    path: p,
                    kind,
                    object,
                }) if p == path && rv > last_sent => {
                    json!({"type": kind, "object": object})
                }
                Ok(Broadcast::Event { .. }) => continue,
                Ok(Broadcast::Bookmark) if bookmarks => {
                    let rv = shared_for_task.0.lock().rv;
                    json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                           "metadata": {"resourceVersion": rv.to_string()}}})
                }
                Ok(Broadcast::Bookmark) => continue,
                Ok(Broadcast::Expire) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = out_tx.send(line(gone)).await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if out_tx.send(line(ev)).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(out_rx),
        ))
        .expect("response")
}
