//! dataplane-agent: follows a calc-server's Sync stream and programs this node's dataplane.
//!
//! `dataplane-agent --server URL --node NAME --driver dry-run [--state-file PATH]`

use std::process::ExitCode;

use dataplane_agent::cli::Cli;
use dataplane_agent::driver::{self, DriverOptions};
use dataplane_agent::{admin, session};
use tracing::info;

fn main() -> ExitCode {
    // --config-file (or DATAPLANE_AGENT_CONFIG_FILE) supplies defaults beneath flags and env;
    // --print-config is answered (and the process exits) inside parse_args.
    let cli: Cli = config_file::parse_args("--config-file", "DATAPLANE_AGENT_CONFIG_FILE", None);
    common::init_logging(&cli.log_level, cli.log_format, "info");
    let config = match cli.session_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let linux = match cli.linux_options() {
        Ok(mut o) => {
            // What the operator set here wins over FelixConfiguration in the datastore.
            o.pinned = dataplane_agent::cli::pinned_felix_settings(
                &config_file::explicit_long_flags::<Cli>(
                    "--config-file",
                    "DATAPLANE_AGENT_CONFIG_FILE",
                ),
            );
            o
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let driver_kind = cli.driver_kind();
    let driver = match driver::build(
        driver_kind,
        &DriverOptions {
            node_name: config.node_name.clone(),
            state_file: cli.state_file.clone(),
            linux,
        },
    ) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    info!(
        node = %config.node_name,
        servers = ?config.servers,
        driver = driver_kind.name(),
        version = env!("CARGO_PKG_VERSION"),
        "starting"
    );
    let admin_listen = cli.admin_listen;
    let result = runtime.block_on(async move {
        let metrics = config.metrics.clone();
        if let Some(addr) = admin_listen {
            if let Err(e) = admin::serve(addr, metrics.clone()).await {
                eprintln!("error: --admin-listen {addr}: {e}");
                return Ok(None);
            }
            info!(%addr, "admin endpoint: /liveness /readiness /metrics /programmed");
        }
        metrics.set_session_running(true);
        // The session runs on a worker thread so a driver's blocking apply can use
        // block_in_place.
        let task = tokio::spawn(session::run(config, driver, common::shutdown_signal()));
        let driver = task.await;
        metrics.set_session_running(false);
        driver.map(Some)
    });
    match result {
        Ok(Some(_driver)) => {
            info!("stopped; the dataplane is left in place");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::from(2),
        Err(e) => {
            eprintln!("error: session task failed: {e}");
            ExitCode::FAILURE
        }
    }
}
