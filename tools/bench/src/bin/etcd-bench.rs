//! etcd-bench: helpers for the etcd cold-start benchmark (docs/benchmarks.md).
//!
//! - `load`: writes a `calc-bench gen-cluster` directory into etcd in Calico's v3 layout
//!   (`/calico/resources/v3/projectcalico.org/<plural>/[<ns>/]<name>`, compact JSON values),
//!   in transactions of `--batch` puts, several in flight.
//! - `list`: the floor: a bare paginated range read of the same prefix at one revision (values
//!   received and kept, nothing decoded), timed.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use bench_tools::etcd_store::{self, PREFIX};
use clap::{Parser, Subcommand};
use etcd_client::{Client, GetOptions};

/// The same allocator as calc-server: `cold-start` times calc-server's own snapshot read, whose
/// decoding is mostly allocation.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "etcd-bench",
    about = "Load a generated cluster into etcd; time a bare list."
)]
struct Cli {
    /// etcd endpoint URLs, comma-separated.
    #[arg(
        long,
        env = "ETCD_BENCH_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    endpoints: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write every object of a gen-cluster directory (JSON arrays) into etcd.
    Load {
        /// A directory written by `calc-bench gen-cluster --out DIR`.
        #[arg(long, env = "ETCD_BENCH_DIR")]
        dir: PathBuf,
        /// Puts per transaction (etcd allows 128 by default).
        #[arg(long, env = "ETCD_BENCH_BATCH", default_value_t = 128)]
        batch: usize,
        /// Transactions in flight.
        #[arg(long, env = "ETCD_BENCH_PARALLEL", default_value_t = 4)]
        parallel: usize,
    },
    /// Time a paginated range read of the Calico v3 prefix at one revision.
    List {
        /// Keys per range request.
        #[arg(long, env = "ETCD_BENCH_PAGE_SIZE", default_value_t = 4000)]
        page_size: i64,
        /// Repetitions; the median is reported.
        #[arg(long, env = "ETCD_BENCH_RUNS", default_value_t = 5)]
        runs: usize,
    },
    /// Time calc-server's etcd snapshot (list, decode and validate every object, as `serve`
    /// and `compute` start) against the bare paginated list, alternating the two, and print
    /// `etcd cold start: ratio <x>` (median against median).
    ColdStart {
        /// Keys per range request, for both.
        #[arg(long, env = "ETCD_BENCH_PAGE_SIZE", default_value_t = 4000)]
        page_size: i64,
        /// Runs of each; the medians are compared.
        #[arg(long, env = "ETCD_BENCH_RUNS", default_value_t = 5)]
        runs: usize,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Checked before connecting: an empty or wrong directory is the user's mistake to hear about
    // first, whatever etcd's state.
    let files = match &cli.command {
        Command::Load { dir, .. } => etcd_store::json_files(dir)?,
        Command::List { .. } | Command::ColdStart { .. } => Vec::new(),
    };
    rt.block_on(async {
        let client = Client::connect(&cli.endpoints, None)
            .await
            .context("connecting to etcd")?;
        match cli.command {
            Command::Load {
                dir,
                batch,
                parallel,
            } => load(client, &dir, files, batch, parallel).await,
            Command::List { page_size, runs } => list(client, page_size, runs.max(1)).await,
            Command::ColdStart { page_size, runs } => {
                cold_start(client, &cli.endpoints, page_size, runs.max(1)).await
            }
        }
    })
}

async fn load(
    client: Client,
    dir: &std::path::Path,
    files: Vec<PathBuf>,
    batch: usize,
    parallel: usize,
) -> anyhow::Result<()> {
    let loaded = etcd_store::load(&client, files, batch, parallel).await?;
    anyhow::ensure!(
        loaded.keys > 0,
        "{} holds no v3 objects Calico stores in etcd; nothing loaded",
        dir.display()
    );
    println!(
        "loaded {} keys, {:.1} MiB of values, in {:.2} s",
        loaded.keys,
        loaded.bytes as f64 / 1048576.0,
        loaded.seconds
    );
    Ok(())
}

async fn list(client: Client, page_size: i64, runs: usize) -> anyhow::Result<()> {
    let mut times = Vec::new();
    let (mut keys, mut bytes) = (0usize, 0usize);
    for _ in 0..runs {
        let (took, k, b) = list_once(&client, page_size).await?;
        times.push(took);
        (keys, bytes) = (k, b);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "listed {keys} keys, {:.1} MiB of values: median {:.0} ms (min {:.0}, max {:.0}) over {runs} runs",
        bytes as f64 / 1048576.0,
        times[times.len() / 2] * 1000.0,
        times[0] * 1000.0,
        times[times.len() - 1] * 1000.0
    );
    Ok(())
}

/// The floor and calc-server's snapshot read, alternated so that both see the same machine.
async fn cold_start(
    client: Client,
    endpoints: &[String],
    page_size: i64,
    runs: usize,
) -> anyhow::Result<()> {
    let args = calc_server::args::EtcdArgs {
        etcd_endpoints: endpoints.to_vec(),
        etcd_ca_file: None,
        etcd_cert_file: None,
        etcd_key_file: None,
        etcd_page_size: page_size,
    };
    let (mut floor, mut ours) = (Vec::new(), Vec::new());
    let mut objects = 0;
    for _ in 0..runs {
        floor.push(list_once(&client, page_size).await?.0);
        let started = Instant::now();
        let (updates, problems) = calc_server::datastore::etcd::watcher::snapshot(&args).await?;
        ours.push(started.elapsed().as_secs_f64());
        anyhow::ensure!(
            problems.is_empty(),
            "{} objects in etcd were refused",
            problems.len()
        );
        objects = updates.len();
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (f, o) = (median(&mut floor), median(&mut ours));
    println!(
        "bare list: median {:.0} ms (min {:.0}, max {:.0}); snapshot (list + decode + validate, {objects} updates): median {:.0} ms (min {:.0}, max {:.0}); {runs} runs each",
        f * 1e3,
        floor[0] * 1e3,
        floor[floor.len() - 1] * 1e3,
        o * 1e3,
        ours[0] * 1e3,
        ours[ours.len() - 1] * 1e3
    );
    println!("etcd cold start: ratio {:.2}", o / f);
    Ok(())
}

/// One paginated read of the Calico prefix at one revision, values kept: (seconds, keys, value
/// bytes).
async fn list_once(client: &Client, page_size: i64) -> anyhow::Result<(f64, usize, usize)> {
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(256 * 1024 * 1024);
    let mut end = PREFIX.as_bytes().to_vec();
    *end.last_mut().expect("non-empty prefix") += 1;
    {
        let started = Instant::now();
        let (mut revision, mut next) = (0i64, PREFIX.as_bytes().to_vec());
        let mut kept = Vec::new();
        loop {
            let mut opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(page_size);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let mut resp = kv.get(next.clone(), Some(opts)).await?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            let more = resp.more();
            let page = resp.take_kvs();
            if let Some(last) = page.last() {
                next = last.key().to_vec();
                next.push(0);
            }
            kept.extend(page);
            if !more {
                break;
            }
        }
        let took = started.elapsed().as_secs_f64();
        let bytes = kept.iter().map(|k| k.value().len()).sum();
        Ok((took, kept.len(), bytes))
    }
}
