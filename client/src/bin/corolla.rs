//! The `corolla` command line; all logic lives in `corolla_client::cli`.

fn main() -> anyhow::Result<()> {
    corolla_client::cli::run()
}
