//! The `corolla-server` binary; all logic lives in the `corolla_server` library.

fn main() -> anyhow::Result<()> {
    corolla_server::run_cli()
}
