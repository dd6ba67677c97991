//! `sandcellctl completions SHELL`: the shell completion script clap generates from the
//! command line itself, so it always matches the subcommands and options.

use super::Outcome;

/// `completions SHELL`.
#[derive(Debug, clap::Args)]
pub struct Completions {
    /// The shell.
    shell: clap_complete::Shell,
}

impl Completions {
    /// Writes the script on standard output; status 0 (also when standard output is a closed
    /// pipe, see [`crate::out::output_failed`]).
    pub fn run(self) -> Outcome {
        let mut script = Vec::new();
        clap_complete::generate(
            self.shell,
            &mut super::command(),
            "sandcellctl",
            &mut script,
        );
        if let Err(e) = std::io::Write::write_all(&mut std::io::stdout(), &script) {
            crate::out::output_failed(e);
        }
        Ok(0)
    }
}
