//! Tokenizer: a HuggingFace `tokenizer.json` through the `tokenizers` crate.
//!
//! Source: HF `tokenizers` (byte-level BPE, as GLM / DeepSeek tokenizers are); the crate
//! is built without `onig` (its C regex library): `fancy-regex` serves the byte-level
//! pre-tokenizer's pattern. Special tokens are the tokenizer's added tokens; speclab
//! names `<|bos|>`, `<|eos|>`, `<|pad|>` and `<|mask|>` (DFlash2's MASK).
//!
//! Invariants: every failure (unreadable file, invalid JSON, unknown special token,
//! an id outside the vocabulary on decode) is an [`EngineError::Tokenizer`] naming the
//! file; nothing panics on user text.

use std::path::Path;

use crate::{EngineError, Result};

/// The mask token DFlash2 drafts with.
pub const MASK_TOKEN: &str = "<|mask|>";
/// Beginning of sequence.
pub const BOS_TOKEN: &str = "<|bos|>";
/// End of sequence.
pub const EOS_TOKEN: &str = "<|eos|>";
/// Padding.
pub const PAD_TOKEN: &str = "<|pad|>";

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it came from (for errors).
    source: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab", &self.vocab_size(true))
            .finish()
    }
}

impl Tokenizer {
    fn err(&self, reason: impl std::fmt::Display) -> EngineError {
        EngineError::Tokenizer {
            path: self.source.clone(),
            reason: reason.to_string(),
        }
    }

    /// Load a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| EngineError::Tokenizer {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parse `tokenizer.json` bytes (`source` names them in errors).
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Self> {
        let inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| EngineError::Tokenizer {
                path: source.into(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            inner,
            source: source.into(),
        })
    }

    /// Text -> ids (`add_special_tokens` applies the post-processor, if any).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids -> text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let n = self.vocab_size(true) as u32;
        if let Some(bad) = ids.iter().find(|&&i| i >= n) {
            return Err(self.err(format!("id {bad} is outside the vocabulary ({n} tokens)")));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.err(e))
    }

    /// Id of a token string, if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id, if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Id of a special (added) token; an error naming it when absent.
    pub fn special_id(&self, token: &str) -> Result<u32> {
        let id = self
            .token_to_id(token)
            .ok_or_else(|| self.err(format!("no token {token:?}")))?;
        if !self
            .inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
        {
            return Err(self.err(format!("{token:?} (id {id}) is not a special token")));
        }
        Ok(id)
    }

    /// Id of `<|mask|>`.
    pub fn mask_token_id(&self) -> Result<u32> {
        self.special_id(MASK_TOKEN)
    }

    /// Special (added) tokens, sorted by id.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(i, t)| (i, t.content))
            .collect();
        v.sort();
        v
    }

    /// Vocabulary size (with or without added tokens).
    pub fn vocab_size(&self, with_added_tokens: bool) -> usize {
        self.inner.get_vocab_size(with_added_tokens)
    }
}
