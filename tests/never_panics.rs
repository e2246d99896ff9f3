//! `gpuslice validate` never panics, whatever the YAML: mutations of the examples (lines
//! dropped, duplicated or re-indented, characters replaced, files cut short) go through the
//! whole pipeline, and every problem points at a line of its file.

use chrono::{TimeZone, Utc};
use gpuslice_source::SourceFile;
use gpuslice_source::validate::validate_files;
use proptest::prelude::*;

fn examples() -> Vec<SourceFile> {
    let spec = gpuslice_source::SourceSpec {
        location: concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gitops").to_string(),
        ..Default::default()
    };
    gpuslice_source::load(&spec).expect("examples load").files
}

#[derive(Clone, Debug)]
enum Mutation {
    DropLine(usize),
    DuplicateLine(usize),
    Indent(usize, bool),
    ReplaceChar(usize, char),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop::sample::select(vec![
        ':', '-', ' ', '{', '}', '[', ']', '"', '\'', '\n', '0', 'x', '#', '&', '*', '|', '>', '!',
        '%', '\t', '?', 'é',
    ]);
    prop_oneof![
        any::<usize>().prop_map(Mutation::DropLine),
        any::<usize>().prop_map(Mutation::DuplicateLine),
        (any::<usize>(), any::<bool>()).prop_map(|(l, deeper)| Mutation::Indent(l, deeper)),
        (any::<usize>(), interesting).prop_map(|(i, c)| Mutation::ReplaceChar(i, c)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(text: &str, m: &Mutation) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let n = lines.len().max(1);
    match *m {
        Mutation::DropLine(i) if !lines.is_empty() => {
            lines.remove(i % n);
        }
        Mutation::DuplicateLine(i) if !lines.is_empty() => {
            let l = lines[i % n].clone();
            lines.insert(i % n, l);
        }
        Mutation::Indent(i, deeper) if !lines.is_empty() => {
            let l = &mut lines[i % n];
            if deeper {
                l.insert_str(0, "  ");
            } else if l.starts_with("  ") {
                l.replace_range(..2, "");
            }
        }
        Mutation::ReplaceChar(i, c) => {
            let chars: Vec<char> = text.chars().collect();
            let at = i % chars.len().max(1);
            return chars
                .iter()
                .enumerate()
                .map(|(j, &o)| if j == at { c } else { o })
                .collect();
        }
        Mutation::Truncate(i) => {
            let chars: Vec<char> = text.chars().collect();
            return chars[..i % (chars.len() + 1)].iter().collect();
        }
        _ => {}
    }
    lines.join("\n")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_repositories_never_panic(file in any::<prop::sample::Index>(), mutations in prop::collection::vec(mutation(), 1..4)) {
        let mut files = examples();
        let target = file.index(files.len());
        for m in &mutations {
            files[target].text = apply(&files[target].text, m);
        }
        let now = Utc.with_ymd_and_hms(2026, 12, 2, 12, 0, 0).unwrap();
        let report = validate_files(&files, now);
        for p in &report.problems {
            let text = &files.iter().find(|f| f.path == p.file).expect("problems name a file").text;
            prop_assert!(p.line >= 1 && p.line <= text.lines().count().max(1) + 1, "{p} (file has {} lines)", text.lines().count());
        }
    }
}
