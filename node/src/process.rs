//! Processes of the node as `/proc` shows them: who started whom, so the agent can tell which
//! claim a process belongs to from its socket's peer credentials.

/// The parent of a process, if it (still) exists.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A process and its ancestors, nearest first (init excluded).
pub fn ancestry(pid: u32) -> Vec<u32> {
    /// Deeper than any real process tree; stops a loop on a pid reused while we walk.
    const MAX_DEPTH: usize = 64;
    let mut chain = vec![pid];
    while let Some(parent) = chain.last().copied().and_then(parent_of) {
        if parent <= 1 || chain.contains(&parent) || chain.len() > MAX_DEPTH {
            break;
        }
        chain.push(parent);
    }
    chain
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_descends_from_its_parent() {
        let me = std::process::id();
        let parent = super::parent_of(me).expect("a parent");
        let chain = super::ancestry(me);
        assert_eq!(chain[0], me);
        if parent > 1 {
            assert_eq!(chain[1], parent);
        }
    }
}
