//! `calibrate`, `profile` and `train-predictors`: each prints the path it wrote.

use anyhow::Result;
use lemo_train::lemo::{InspectArgs, TrainPredictorsArgs};

pub fn calibrate(args: InspectArgs) -> Result<()> {
    println!("{}", lemo_train::lemo::run_calibrate(args)?.display());
    Ok(())
}

pub fn profile(args: InspectArgs) -> Result<()> {
    println!("{}", lemo_train::lemo::run_profile(args)?.display());
    Ok(())
}

pub fn train_predictors(args: TrainPredictorsArgs) -> Result<()> {
    println!(
        "{}",
        lemo_train::lemo::run_train_predictors(args)?.display()
    );
    Ok(())
}
