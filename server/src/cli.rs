//! The `corolla-server` binary's body: flags, logging, the runtime, and a
//! graceful leave on Ctrl-C or SIGTERM.

use crate::config::ServerArgs;
use crate::Server;

/// The `corolla-server` binary's body.
pub fn run_cli() -> anyhow::Result<()> {
    let args = match ServerArgs::from_env() {
        Ok(args) => args,
        Err(crate::config::ArgsError::Flags(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libp2p=warn,webrtc=error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let server = Server::start(args).await?;
        tracing::info!(
            peer_id = %server.peer_id(),
            model = server.model(),
            blocks = ?server.blocks(),
            "ready; serving until Ctrl-C or SIGTERM"
        );
        for addr in server.addrs() {
            println!("{addr}");
        }
        stop_signal().await?;
        tracing::info!("leaving the swarm");
        server.leave().await;
        Ok(())
    })
}

/// Ctrl-C, or (on Unix) SIGTERM as service managers send it.
async fn stop_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
