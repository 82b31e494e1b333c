use std::path::{Path, PathBuf};

/// Everything that can go wrong reading a model, tokenizer or adapter. Each variant prints as one
/// line that names the file or field at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Format { path: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Shape(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub fn write(path: &Path, source: std::io::Error) -> Self {
        Error::Write {
            path: path.to_path_buf(),
            source,
        }
    }

    pub fn format(path: &Path, message: impl Into<String>) -> Self {
        Error::Format {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}
