//! The GGUF container (versions 2 and 3; all fields little-endian): the magic `GGUF`, a u32
//! version, u64 tensor and metadata counts, the metadata as typed key/value pairs, one entry
//! per tensor (name, dimensions innermost first, ggml type, offset into the data section), then
//! the data section, which starts at the next multiple of `general.alignment` (default 32).
//!
//! Every length and count read from the file is checked against the bytes that remain before
//! anything is allocated, so a corrupt or hostile header ends in an error, not a panic or an
//! allocation of the size it claims.

use std::collections::HashMap;

use super::quant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: usize = 4;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer value that is non-negative, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(values) => Some(values),
            _ => None,
        }
    }
}

/// One entry of the tensor table, checked against the file: its bytes lie inside it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Dimensions as ggml lists them, innermost (contiguous) first: the reverse of the
    /// row-major shape.
    pub dims: Vec<usize>,
    pub ggml_type: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// The row-major shape (outermost first), as Hugging Face checkpoints give it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A parsed header: the metadata and the tensor table.
#[derive(Debug, Clone)]
pub struct Header {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
}

impl Header {
    /// Parses the header of a GGUF file held in `bytes`; errors are one line, without the path.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let mut cursor = Cursor { bytes, at: 0 };
        if cursor.take(4).map_err(|_| "not a GGUF file (too short)")? != MAGIC {
            return Err("not a GGUF file (no GGUF magic at the start)".into());
        }
        let version = cursor.u32()?;
        if !(2..=3).contains(&version) {
            return Err(format!(
                "GGUF version {version} is not supported (lemo reads versions 2 and 3)"
            ));
        }
        let tensor_count = cursor.u64()?;
        let metadata_count = cursor.u64()?;
        let mut metadata = HashMap::new();
        for index in 0..metadata_count {
            let key = cursor
                .string()
                .map_err(|e| format!("metadata entry {index}: {e}"))?;
            let value_type = cursor.u32()?;
            let value = cursor
                .value(value_type)
                .map_err(|e| format!("metadata {key:?}: {e}"))?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => value
                .as_u64()
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| format!("general.alignment {value:?} is not a power of two"))?,
        };

        let mut entries = Vec::new();
        for index in 0..tensor_count {
            let name = cursor
                .string()
                .map_err(|e| format!("tensor entry {index}: {e}"))?;
            let entry = cursor
                .tensor_entry()
                .map_err(|e| format!("tensor {name:?}: {e}"))?;
            entries.push((name, entry));
        }
        let data_start = (cursor.at as u64).next_multiple_of(alignment);

        let mut tensors = HashMap::new();
        for (name, (dims, type_id, offset)) in entries {
            let info = Self::locate(bytes.len(), data_start, alignment, dims, type_id, offset)
                .map_err(|e| format!("tensor {name:?}: {e}"))?;
            if tensors.insert(name.clone(), info).is_some() {
                return Err(format!("tensor {name:?} is listed twice"));
            }
        }
        Ok(Self {
            version,
            metadata,
            tensors,
        })
    }

    /// Checks one tensor's type, size and placement against a file of `file_len` bytes.
    fn locate(
        file_len: usize,
        data_start: u64,
        alignment: u64,
        dims: Vec<usize>,
        type_id: u32,
        offset: u64,
    ) -> Result<TensorInfo, String> {
        let ggml_type = GgmlType::from_id(type_id)?;
        let count = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("dimensions {dims:?} overflow"))?;
        let len = ggml_type.byte_size(dims.first().copied().unwrap_or(1), count)?;
        if !offset.is_multiple_of(alignment) {
            return Err(format!(
                "data offset {offset} is not aligned to {alignment} bytes"
            ));
        }
        let start = data_start
            .checked_add(offset)
            .filter(|&s| s <= file_len as u64)
            .ok_or_else(|| {
                format!("data offset {offset} lies past the end of the file (file truncated?)")
            })? as usize;
        if file_len - start < len {
            return Err(format!(
                "needs {len} bytes of {ggml_type:?} data for dimensions {dims:?} but the file \
                 ends {} bytes after its start (file truncated?)",
                file_len - start
            ));
        }
        Ok(TensorInfo {
            dims,
            ggml_type,
            start,
            len,
        })
    }
}

/// Little-endian fields read off a byte slice; every read checks the bytes left.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, count: usize) -> Result<&'a [u8], String> {
        let rest = &self.bytes[self.at..];
        if rest.len() < count {
            return Err(format!(
                "file truncated: needs {count} more bytes at offset {}, has {}",
                self.at,
                rest.len()
            ));
        }
        self.at += count;
        Ok(&rest[..count])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// A u64 count of items at least `min_item_bytes` long each, which must fit in the rest.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, String> {
        let count = self.u64()?;
        usize::try_from(count)
            .ok()
            .filter(|&n| n.saturating_mul(min_item_bytes) <= self.remaining())
            .ok_or_else(|| {
                format!(
                    "claims {count} items, more than the {} bytes left can hold (file truncated or corrupt)",
                    self.remaining()
                )
            })
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.count(1)?;
        Ok(String::from_utf8_lossy(self.take(len)?).into_owned())
    }

    fn value(&mut self, value_type: u32) -> Result<Value, String> {
        Ok(match value_type {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(format!("bool value {other} is neither 0 nor 1")),
            },
            8 => Value::String(self.string()?),
            9 => {
                let element_type = self.u32()?;
                if element_type == 9 {
                    // Nested arrays are legal GGUF but no model key uses them; refusing them
                    // also bounds the recursion depth.
                    return Err("arrays of arrays are not supported".into());
                }
                let count = self.count(Self::min_value_bytes(element_type)?)?;
                let mut values = Vec::with_capacity(count);
                for _ in 0..count {
                    values.push(self.value(element_type)?);
                }
                Value::Array(values)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }

    /// The fewest bytes a value of `value_type` takes (a string: its u64 length).
    fn min_value_bytes(value_type: u32) -> Result<usize, String> {
        Ok(match value_type {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            other => return Err(format!("unknown array element type {other}")),
        })
    }

    /// Dimensions (innermost first), ggml type id and data offset of a tensor entry.
    fn tensor_entry(&mut self) -> Result<(Vec<usize>, u32, u64), String> {
        let n_dims = self.u32()? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("{n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"));
        }
        let dims = (0..n_dims)
            .map(|_| {
                let dim = self.u64()?;
                usize::try_from(dim).map_err(|_| format!("dimension {dim} is too large"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let type_id = self.u32()?;
        let offset = self.u64()?;
        Ok((dims, type_id, offset))
    }
}
