//! Starting a server, one named step after another: check the flags, open
//! the model, join the swarm, choose and load the blocks, settle the host
//! settings, start the acceptors and HTTP, announce, and hand back the
//! [`RunningServer`].

mod acceptors;
mod blocks;
mod settings;
mod swarm;

use corolla_shared::addr_file::AddrFile;
use corolla_shared::peers::split_peer;
use libp2p::{Multiaddr, PeerId};

use crate::config::{BalanceQuality, ServerArgs};
use crate::error::ServerError;
use crate::host::SpanHost;
use crate::rebalance::Rebalancer;
use crate::running::RunningServer;
use blocks::OpenedModel;
use swarm::JoinedSwarm;

pub struct Server;

impl Server {
    pub async fn start(args: ServerArgs) -> Result<RunningServer, ServerError> {
        match corolla_http::raise_open_file_limit() {
            Some(n) => tracing::debug!(open_files = n, "open-file limit"),
            None => tracing::debug!("cannot read the open-file limit"),
        }
        let initial_peers = check_args(&args)?;
        let model = OpenedModel::open(&args).await?;
        let swarm = JoinedSwarm::join(&args, &initial_peers).await?;

        let (start, end) = model
            .choose_span(&args, &swarm.node, !initial_peers.is_empty())
            .await?;
        tracing::info!(model = %model.name, start, end, "loading blocks");
        let loader = model.loader(&args);
        let loaded = loader.load(start, end).await?;
        let settings = settings::host_settings(&args, &model, &swarm, &loaded);
        let hosted = settings.host(loaded)?;
        let announcement = settings.announcement(&hosted);
        let host = SpanHost::new(hosted);

        let mut tasks = vec![swarm.task];
        tasks.extend(acceptors::spawn_acceptors(&swarm.node, &host, &settings)?);
        let http = crate::http::start(
            &args,
            model.checkpoint.clone(),
            model.source.clone(),
            &model.name,
            host.clone(),
            swarm.tls,
            &swarm.addrs,
            swarm.node.clone(),
            swarm.metrics.clone(),
        )
        .await?
        .map(|(url, task)| {
            tasks.push(task);
            url
        });
        swarm
            .node
            .announce(Some(announcement))
            .await
            .map_err(|e| ServerError::Network(e.to_string()))?;
        let sessions = settings.sessions.clone();
        let rebalancer = match args.balance_quality {
            BalanceQuality::Gain(quality) if settings::rebalances(&args) => Some(tokio::spawn(
                Rebalancer {
                    node: swarm.node.clone(),
                    host: host.clone(),
                    settings,
                    loader,
                    sessions: sessions.clone(),
                    num_layers: model.config.num_hidden_layers,
                    period: args.update_period,
                    quality,
                    drain_timeout: args.drain_timeout,
                }
                .run(),
            )),
            _ => None,
        };

        let peer_id = swarm.node.peer_id();
        if let Some(path) = &args.addr_file {
            AddrFile {
                peer_id: peer_id.to_string(),
                addrs: swarm.addrs.iter().map(ToString::to_string).collect(),
                model: model.name.clone(),
                start,
                end,
                http: http.clone(),
            }
            .write(path)?;
        }
        Ok(RunningServer {
            peer_id,
            addrs: swarm.addrs,
            model: model.name,
            node: swarm.node,
            tasks,
            rebalancer,
            http,
            host,
            sessions,
            drain_timeout: args.drain_timeout,
            metrics: swarm.metrics,
        })
    }
}

/// The flag combinations no step can serve; returns the initial peers split
/// into their ids and where to dial them.
fn check_args(args: &ServerArgs) -> Result<Vec<(PeerId, Multiaddr)>, ServerError> {
    if args.new_swarm != args.initial_peers.is_empty() {
        return Err(ServerError::BadArgs(
            "pass --new-swarm to start a swarm, or --initial-peers to join one".into(),
        ));
    }
    if args.max_sessions == 0 || args.inference_max_length == 0 {
        return Err(ServerError::BadArgs(
            "--max-sessions and --inference-max-length must be positive".into(),
        ));
    }
    let initial_peers = args
        .initial_peers
        .iter()
        .map(split_peer)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(initial_peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> ServerArgs {
        let argv = std::iter::once("corolla-server")
            .chain(flags.iter().copied())
            .map(String::from)
            .collect();
        match ServerArgs::from_args_and_file(argv) {
            Ok(args) => args,
            Err(e) => panic!("flags {flags:?}: {e}"),
        }
    }

    fn refusal(flags: &[&str]) -> ServerError {
        match check_args(&args(flags)) {
            Ok(_) => panic!("{flags:?} were accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn contradicting_flags_are_refused_as_bad_args_before_any_step() {
        // (--new-swarm with --initial-peers is clap's to refuse.)
        assert_eq!(refusal(&["--model", "m"]).kind(), "bad_args");
        let no_sessions = ["--model", "m", "--new-swarm", "--max-sessions", "0"];
        assert_eq!(refusal(&no_sessions).kind(), "bad_args");
        let no_id = ["--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1"];
        let e = refusal(&no_id);
        assert_eq!(e.kind(), "bad_args", "{e}");
    }

    #[test]
    fn good_flags_pass_with_the_initial_peers_split() {
        let peer = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
        let flags = [
            "--model",
            "m",
            "--initial-peers",
            &format!("/ip4/127.0.0.1/tcp/1/p2p/{peer}"),
        ];
        let flags: Vec<&str> = flags.iter().map(|s| s.as_ref()).collect();
        let peers = check_args(&args(&flags)).map_err(|e| e.to_string());
        let peers = peers.unwrap_or_else(|e| panic!("refused: {e}"));
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].0.to_string(), peer);
        assert_eq!(peers[0].1.to_string(), "/ip4/127.0.0.1/tcp/1");
    }
}
