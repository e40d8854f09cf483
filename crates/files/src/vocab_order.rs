//! Vocabulary-order files (`headkl bench --vocab-order FILE`): token ids
//! separated by whitespace, position by position.

use std::path::Path;

use headkl_core::VocabOrder;

use crate::error::FilesError;

/// A vocabulary-order file's text: token ids separated by whitespace,
/// position by position, each id of `0..n` once. Anything else is an error
/// naming the file and the first id at fault ([`FilesError::File`]).
pub fn parse(path: &Path, text: &str) -> Result<VocabOrder, FilesError> {
    let bad = |problem: String| FilesError::file(path, problem);
    let ids = text
        .split_whitespace()
        .enumerate()
        .map(|(p, w)| {
            w.parse::<u32>()
                .map_err(|e| bad(format!("position {p}: `{}`: {e}", w.escape_debug())))
        })
        .collect::<Result<Vec<u32>, _>>()?;
    if ids.is_empty() {
        return Err(bad("holds no token ids".into()));
    }
    VocabOrder::new(ids).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_reads_and_a_bad_one_names_the_file_and_position() {
        let order = parse(Path::new("o.txt"), "2 0\n1\t3").unwrap();
        assert_eq!(order.len(), 4);
        assert_eq!(order.id(0), 2);
        let e = parse(Path::new("o.txt"), "0 x 1").unwrap_err();
        assert!(e.is_input());
        assert_eq!(e.to_string(), "o.txt: position 1: `x`: invalid digit found in string");
        assert!(parse(Path::new("o.txt"), " \n")
            .unwrap_err()
            .to_string()
            .contains("no token ids"));
        assert!(parse(Path::new("o.txt"), "0 0").is_err());
    }
}
