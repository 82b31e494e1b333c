//! The token cache's file format: little-endian u32 words, the document count, then per
//! document its length, whether it carries an assistant mask, its token ids and the mask's bits
//! (32 tokens a word).

use super::Document;

/// Part of every cache key: a file written in another layout is never read as this one.
pub const FORMAT: &str = "lemo-tokens-2";

pub fn encode(docs: &[Document]) -> Vec<u8> {
    let mut words = vec![docs.len() as u32];
    for doc in docs {
        words.push(doc.tokens.len() as u32);
        words.push(u32::from(doc.assistant.is_some()));
        words.extend(&doc.tokens);
        if let Some(mask) = &doc.assistant {
            words.extend(mask.chunks(32).map(|bits| {
                bits.iter()
                    .enumerate()
                    .fold(0u32, |word, (i, &b)| word | (u32::from(b) << i))
            }));
        }
    }
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

pub fn decode(bytes: &[u8]) -> Option<Vec<Document>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut words = bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let count = words.next()?;
    // A corrupt file's count is not trusted with an allocation: it is checked against the bytes.
    let mut docs = Vec::with_capacity((count as usize).min(bytes.len() / 4));
    for _ in 0..count {
        let len = words.next()? as usize;
        let masked = match words.next()? {
            0 => false,
            1 => true,
            _ => return None,
        };
        let tokens: Vec<u32> = words.by_ref().take(len).collect();
        if tokens.len() != len {
            return None;
        }
        let assistant = match masked {
            false => None,
            true => {
                let bits: Vec<u32> = words.by_ref().take(len.div_ceil(32)).collect();
                if bits.len() != len.div_ceil(32) {
                    return None;
                }
                Some(
                    (0..len)
                        .map(|i| bits[i / 32] >> (i % 32) & 1 == 1)
                        .collect(),
                )
            }
        };
        docs.push(Document { tokens, assistant });
    }
    words.next().is_none().then_some(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_and_masks_round_trip() {
        let mask: Vec<bool> = (0..70).map(|i| i % 3 == 0 || i > 60).collect();
        let docs = vec![
            Document::plain(vec![1, 2, 3]),
            Document::plain(vec![]),
            Document {
                tokens: (0..70).collect(),
                assistant: Some(mask),
            },
            Document::plain(vec![7]),
        ];
        let bytes = encode(&docs);
        assert_eq!(decode(&bytes).unwrap(), docs);
        assert!(decode(&bytes[..bytes.len() - 4]).is_none(), "truncated");
    }
}
