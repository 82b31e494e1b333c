//! One rank's model replica on its device: the model with its adapters, the token elimination
//! of `--method lemo`, and the optimizer. Every rank applies the same update to the same
//! averaged gradients, so the replicas stay identical without sending parameters around.

use std::path::Path;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use lemo_kernels::LemoBackend;
use lemo_kernels::exchange::Exchange;
use lemo_models::CausalLm;
use lemo_models::loss::Batch;
use lemo_models::sequence_split::SequenceSplit;
use lemo_sparsity::calibration::Block;

use super::checkpoint::{CheckpointFiles, TrainerState};
use super::optim::{self, AdamW, AdamWSettings, NamedTensors};
use super::setup::Setup;
use super::shard::Shard;
use super::step::forward_backward;
use crate::data::{Sequence, int_labels, int_tokens};
use crate::lemo::{self, Elimination, THRESHOLDS_FILE, sparse_keep, threshold_cache};
use crate::memory::PeakTracker;
use crate::method::Method;
use crate::modelio::TRAINING_INFO_FILE;

type AB<B> = Autodiff<B>;

/// What one rank's micro-batches of a step measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalStep {
    /// Unscaled loss summed over the rank's predictions.
    pub loss_sum: f64,
    pub predictions: usize,
    /// Kept fractions of `--method lemo`, averaged over the micro-batches.
    pub keep_attention: f64,
    pub keep_mlp: f64,
    /// Memory in use after the forward pass (the largest over the micro-batches).
    pub after_forward: u64,
}

pub struct Replica<B: LemoBackend> {
    pub device: B::Device,
    pub model: CausalLm<AB<B>>,
    pub optimizer: AdamW<B>,
    pub elimination: Option<Elimination>,
}

impl<B: LemoBackend> Replica<B> {
    /// Loads the model onto `device` with fresh adapters (or the resumed checkpoint's).
    /// `rank` 0 writes the run's shared files (the thresholds).
    pub fn load(setup: &Setup, device: B::Device, rank: usize) -> Result<Self> {
        let config = &setup.config;
        AB::<B>::seed(&device, config.seed);
        lemo_kernels::memory::set_pool_budget::<B>(&device, setup.pool_budget);
        let (mut model, _, frozen) = CausalLm::<AB<B>>::from_path_quantized(
            &setup.model_path,
            &device,
            setup.precision.policy(),
            config.runtime.quantize_base(),
        )?;
        if rank == 0 {
            frozen.lines().iter().for_each(|line| eprintln!("{line}"));
        }
        if let Some(rope) = &setup.rope {
            model = model.with_rope(rope)?;
        }
        model = model
            .with_new_lora(&setup.lora, config.seed)?
            .set_extra_trainable(&setup.lora)?;
        model.set_shifted_group(config.s2.group(config.method, setup.seq_len)?);
        if config.context_parallel > 1 && !model.splits_sequences() {
            bail!(
                "--context-parallel {}: this model's sequences do not split over ranks (context parallelism needs rotary positions and no sliding window: Llama-2/3, TinyLlama, SmolLM2, not OPT or Mistral)",
                config.context_parallel
            );
        }
        let elimination = elimination(setup, &model, rank)?;
        let mut optimizer = AdamW::<B>::new(AdamWSettings {
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: config.weight_decay,
        });
        if let Some(files) = &setup.resumed {
            let values: NamedTensors<B> = files
                .trainable
                .iter()
                .map(|(name, v)| {
                    let data = TensorData::new(v.clone(), [v.len()]);
                    (name.clone(), Tensor::<B, 1>::from_data(data, &device))
                })
                .collect();
            model = optim::set_trainable(model, values).with_context(|| {
                format!(
                    "the checkpoint of step {} does not match this model and adapter",
                    files.state.step
                )
            })?;
            optimizer.load_state(files.optimizer_step, files.optimizer.clone(), &device)?;
        }
        Ok(Self {
            device,
            model,
            optimizer,
            elimination,
        })
    }

    /// Sizes of the trainable parameters by module path: the layout of the gradient bucket.
    pub fn layout(&self) -> Vec<(String, usize)> {
        optim::trainable_values::<AB<B>, _>(&self.model)
            .into_iter()
            .map(|(name, value)| (name, value.dims()[0]))
            .collect()
    }

    /// Forward and backward passes of this rank's micro-batches of `step` (with a
    /// `sequence_group`, of this rank's positions of them). The gradients are scaled so that
    /// their sum over the ranks is the gradient of the mean loss of the global batch.
    pub fn accumulate(
        &self,
        setup: &Setup,
        (shard, sequence_group): (&Shard, Option<&Exchange>),
        step: usize,
        peak: &mut PeakTracker,
    ) -> Result<(NamedTensors<B>, LocalStep)> {
        let config = &setup.config;
        let mut grads = NamedTensors::<B>::new();
        let mut local = LocalStep::default();
        // Every rank counts the global batch's scored predictions from the shared corpus (the
        // same number everywhere, without a collective), so that masked sequences weigh as
        // their scored tokens do, as in one large batch.
        let predictions: usize = shard
            .global_batch(step)
            .map(|i| setup.corpus.train_sequence(i).predictions())
            .sum();
        let scale = 1.0 / predictions.max(1) as f64;
        for micro in 0..config.grad_accum {
            let sequences: Vec<Sequence> = shard
                .sequences(step, micro)
                .map(|i| setup.corpus.train_sequence(i))
                .collect();
            let tokens = int_tokens::<AB<B>>(&sequences, &self.device);
            let seq = tokens.dims()[1];
            let batch = Batch {
                tokens,
                labels: int_labels::<AB<B>>(&sequences, &self.device),
                split: sequence_group
                    .map(|group| SequenceSplit::zigzag(seq, group.clone()))
                    .transpose()?,
            };
            let mut token_sparsity = lemo::token_sparsity(self.elimination.as_ref());
            let (loss, n, mem) = forward_backward(
                &self.model,
                batch,
                config.loss_segment,
                scale,
                &setup.activations,
                &mut token_sparsity,
                &mut grads,
            );
            if let Some(plan) = token_sparsity.into_plan() {
                local.keep_attention +=
                    sparse_keep(&plan, Block::Attention) / config.grad_accum as f64;
                local.keep_mlp += sparse_keep(&plan, Block::Mlp) / config.grad_accum as f64;
            }
            local.loss_sum += loss;
            local.predictions += n;
            local.after_forward = local.after_forward.max(mem);
            peak.peak = peak.peak.max(mem);
            peak.record();
        }
        Ok((grads, local))
    }

    /// One AdamW update with `grads` at learning rate `lr`.
    pub fn update(&mut self, grads: &NamedTensors<B>, lr: f64) -> Result<()> {
        let params = optim::trainable_values::<AB<B>, _>(&self.model);
        let updated = self.optimizer.step(params, grads, lr);
        self.model = optim::set_trainable(self.model.clone(), updated)?;
        Ok(())
    }

    /// The PEFT adapter, the thresholds it was trained with and the training record, in `dir`.
    pub fn write_adapter(&self, setup: &Setup, dir: &Path) -> Result<()> {
        let inner = self.model.valid();
        inner.save_adapter(dir, &setup.lora, &setup.model_path.display().to_string())?;
        if let Some(elimination) = &self.elimination {
            lemo::write_thresholds(&dir.join(THRESHOLDS_FILE), &elimination.thresholds)?;
        }
        lemo_models::adapter::write_atomically(
            &dir.join(TRAINING_INFO_FILE),
            serde_json::to_string_pretty(&setup.info)?.as_bytes(),
        )?;
        Ok(())
    }

    /// What a checkpoint holds of the model and optimizer after `state.step` steps.
    pub fn checkpoint_files(&self, state: TrainerState) -> CheckpointFiles {
        CheckpointFiles {
            state,
            trainable: optim::trainable_values::<AB<B>, _>(&self.model)
                .into_iter()
                .map(|(k, t)| (k, t.into_data().convert::<f32>().into_vec().expect("f32")))
                .collect(),
            optimizer: self.optimizer.state_tensors(),
            optimizer_step: self.optimizer.step,
        }
    }
}

/// Token elimination of `--method lemo`: the run's thresholds, from --thresholds, from its
/// predictors, from the run folder when resuming, or calibrated on the first training sequences
/// with the fresh adapter (every rank calibrates on the same sequences and so gets the same
/// thresholds; rank 0 writes them); scores from the predictors unless --scores exact.
fn elimination<B: LemoBackend>(
    setup: &Setup,
    model: &CausalLm<AB<B>>,
    rank: usize,
) -> Result<Option<Elimination>> {
    let config = &setup.config;
    if config.method != Method::Lemo {
        return Ok(None);
    }
    let settings = config.lemo.clone();
    settings.check_sequence(model, setup.seq_len)?;
    if settings.keep_exactly && rank == 0 {
        eprintln!(
            "lemo: every token-eliminating block keeps exactly {:.3} (attention) / {:.3} (MLP) of each sequence's blocks",
            settings.block_keep(Block::Attention),
            settings.block_keep(Block::Mlp)
        );
    }
    let saved = config.out.join(THRESHOLDS_FILE);
    let interpolation = Some(setup.rope.as_ref().map_or(1.0, |r| r.scaling.factor()));
    let elimination = lemo::elimination(&settings, &setup.model_config, interpolation, || {
        if setup.resumed.is_some() && saved.exists() {
            return lemo::read_thresholds(&saved, &setup.model_config);
        }
        let count = settings.calibration_sequences.min(setup.corpus.train_len());
        let sequences: Vec<Vec<u32>> = (0..count)
            .map(|i| setup.corpus.train_sequence(i).tokens)
            .collect();
        let context = format!("{:?} {}", setup.rope, setup.precision.name());
        let cached = config.cache_dir().and_then(|dir| {
            threshold_cache::entry(&dir, &setup.model_path, &settings, &context, &sequences)
        });
        if let Some(entry) = cached.as_ref().filter(|entry| entry.exists()) {
            match lemo::read_thresholds(entry, &setup.model_config) {
                Ok(thresholds) => {
                    if rank == 0 {
                        eprintln!(
                            "lemo: thresholds calibrated earlier on the same model, sequences and settings: {}",
                            entry.display()
                        );
                    }
                    return Ok(thresholds);
                }
                Err(error) if rank == 0 => {
                    eprintln!("lemo: calibrating again ({error:#})")
                }
                Err(_) => {}
            }
        }
        if rank == 0 {
            eprintln!(
                "lemo: calibrating per-layer thresholds on {count} training sequences toward kept fractions of {} (attention) / {} (MLP)",
                settings.block_keep(Block::Attention),
                settings.block_keep(Block::Mlp)
            );
        }
        let thresholds = lemo::calibrate(
            &model.valid(),
            &setup.model_config,
            &setup.model_path.display().to_string(),
            &sequences,
            &settings,
            rank == 0,
        )?;
        if let (Some(entry), 0) = (&cached, rank) {
            threshold_cache::store(entry, &thresholds);
        }
        Ok(thresholds)
    })?;
    if rank == 0 {
        lemo::write_thresholds(&saved, &elimination.thresholds)?;
    }
    Ok(Some(elimination))
}

/// Device memory probe: unused where `B` keeps no pools (the CPU backend, whose tensors live in
/// host memory, is measured by the process's resident set instead).
pub fn has_device_memory<B: LemoBackend>(device: &B::Device) -> bool {
    let stats = lemo_kernels::memory::memory_stats::<B>(device);
    stats.bytes_reserved > 0 || stats.device_total.is_some()
}
