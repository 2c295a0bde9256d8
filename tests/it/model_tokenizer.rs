//! The tokenizer wrapper against ids produced by the Python `tokenizers` package.
//!
//! Fixture: `tests/fixtures/tokenizer/tokenizer.json` (a 320-token byte-level BPE) and
//! `expected.json`, both written by `tests/fixtures/tokenizer/make.py`. Checks: encode
//! (with and without the `<|bos|>` post-processor) gives Python's ids, decode round-trips
//! the text, special ids (`<|mask|>` for DFlash2), and errors for bad inputs.

use std::path::{Path, PathBuf};

use speclab_engine::model::tokenizer::{BOS_TOKEN, EOS_TOKEN, MASK_TOKEN, PAD_TOKEN};
use speclab_engine::model::Tokenizer;
use speclab_engine::EngineError;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

#[test]
fn ids_equal_python_and_round_trip() {
    let tok = Tokenizer::from_file(&dir().join("tokenizer.json")).unwrap();
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap())
            .unwrap();
    assert_eq!(
        tok.vocab_size(true) as u64,
        exp["vocab_size"].as_u64().unwrap()
    );
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let cases = exp["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, ids(&c["ids"]), "ids of {text:?}");
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&c["ids_with_special"]),
            "ids with <|bos|> of {text:?}"
        );
        assert_eq!(
            tok.decode(&got, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
        assert_eq!(
            tok.decode(&got, false).unwrap(),
            c["decoded"].as_str().unwrap()
        );
    }
}

#[test]
fn special_tokens() {
    let tok = Tokenizer::from_file(&dir().join("tokenizer.json")).unwrap();
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("expected.json")).unwrap())
            .unwrap();
    for name in [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, MASK_TOKEN] {
        assert_eq!(
            u64::from(tok.special_id(name).unwrap()),
            exp["special"][name].as_u64().unwrap(),
            "{name}"
        );
    }
    assert_eq!(tok.mask_token_id().unwrap(), 3);
    assert_eq!(tok.special_tokens().len(), 4);
    // Special tokens in text are recognised; skipped on decode when asked.
    let ids = tok.encode("<|mask|><|mask|> hello<|eos|>", false).unwrap();
    assert_eq!(&ids[..2], &[3, 3]);
    assert_eq!(*ids.last().unwrap(), 1);
    assert_eq!(tok.decode(&ids, true).unwrap(), " hello");
}

#[test]
fn tokenizer_errors() {
    let tok = Tokenizer::from_file(&dir().join("tokenizer.json")).unwrap();
    let e = tok.special_id("<|nope|>").unwrap_err();
    assert!(
        matches!(e, EngineError::Tokenizer { .. }) && e.to_string().contains("<|nope|>"),
        "{e}"
    );
    let e = tok.special_id("a").unwrap_err();
    assert!(e.to_string().contains("not a special token"), "{e}");
    let e = tok.decode(&[5, 100_000], false).unwrap_err();
    assert!(
        e.to_string().contains("100000") && e.to_string().contains("tokenizer.json"),
        "{e}"
    );
    let e = Tokenizer::from_file(&dir().join("missing.json")).unwrap_err();
    assert!(e.to_string().contains("missing.json"), "{e}");
    let e = Tokenizer::from_bytes(b"{\"model\": 3}", "inline").unwrap_err();
    assert!(e.to_string().contains("inline"), "{e}");
}
