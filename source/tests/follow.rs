//! Following a real local Git repository: new commits, force-pushes, a remote that disappears.

use std::path::Path;

use gpuslice_source::{Follower, SourceSpec};

fn commit(repo: &git2::Repository, file: &str, text: &str, parent: Option<git2::Oid>) -> git2::Oid {
    let workdir = repo.workdir().unwrap();
    std::fs::write(workdir.join(file), text).unwrap();
    let mut index = repo.index().unwrap();
    index.add_path(Path::new(file)).unwrap();
    index.write().unwrap();
    let tree = repo.find_tree(index.write_tree().unwrap()).unwrap();
    let sig = git2::Signature::now("test", "test@example.com").unwrap();
    let parents: Vec<git2::Commit> = parent
        .map(|p| repo.find_commit(p).unwrap())
        .into_iter()
        .collect();
    let parents: Vec<&git2::Commit> = parents.iter().collect();
    let oid = repo
        .commit(None, &sig, &sig, text, &tree, &parents)
        .unwrap();
    // Move the branch HEAD names, rewriting history when `parent` is not its tip (a force-push).
    let head = repo.find_reference("HEAD").unwrap();
    let branch = head.symbolic_target().unwrap().unwrap().to_string();
    repo.reference(&branch, oid, true, "test").unwrap();
    oid
}

#[test]
fn a_followed_repository_moves_with_commits_and_force_pushes_and_outlives_its_remote() {
    let dir = tempfile::tempdir().unwrap();
    let origin = dir.path().join("origin");
    let repo = git2::Repository::init(&origin).unwrap();
    let first = commit(&repo, "a.yaml", "one: 1\n", None);
    let mut follower = Follower::new(
        SourceSpec {
            location: origin.display().to_string(),
            git_ref: None,
            sub_path: None,
        },
        &dir.path().join("cache"),
    );
    let poll = follower.poll().unwrap();
    assert_eq!(
        poll.snapshot.revision,
        Some(first.to_string()),
        "the default branch"
    );
    assert_eq!(poll.snapshot.files[0].text, "one: 1\n");

    let second = commit(&repo, "a.yaml", "two: 2\n", Some(first));
    assert_eq!(
        follower.poll().unwrap().snapshot.revision,
        Some(second.to_string())
    );

    // Force-push: the branch moves to a commit that does not descend from the one we have.
    let rewritten = commit(&repo, "a.yaml", "three: 3\n", Some(first));
    let poll = follower.poll().unwrap();
    assert_eq!(poll.snapshot.revision, Some(rewritten.to_string()));
    assert_eq!(poll.snapshot.files[0].text, "three: 3\n");

    drop(repo);
    std::fs::remove_dir_all(&origin).unwrap();
    let poll = follower.poll().unwrap();
    assert_eq!(
        poll.snapshot.revision,
        Some(rewritten.to_string()),
        "the last fetched commit"
    );
    let warning = poll.warning.unwrap();
    assert!(
        warning.contains("fetch failed") && warning.contains("keeping commit"),
        "{warning}"
    );
}
