//! Placeholder subcommand (being written).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> xdna::Result<()> {
    Err(xdna::Error::Usage("not yet implemented".into()))
}
