//! `merge`: prints the folder it wrote.

use anyhow::Result;
pub use lemo_train::merge::MergeArgs;

pub fn run(args: MergeArgs) -> Result<()> {
    println!("{}", lemo_train::merge::run(args)?.display());
    Ok(())
}
