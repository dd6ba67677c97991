//! `sandcellctl kernel -f CONNECTION_FILE --kernel NAME`: a Jupyter kernel
//! ([`crate::jupyter`]).

use super::{Ctx, Outcome};
use std::path::PathBuf;

/// Arguments of `kernel`.
#[derive(Debug, clap::Args)]
pub struct Kernel {
    /// The connection file Jupyter wrote (its ports and signing key).
    #[arg(short = 'f', long = "connection-file", value_name = "FILE")]
    connection_file: PathBuf,
    /// The kernel: sandcell-python, sandcell-pydata or sandcell-r.
    #[arg(long, value_name = "NAME", default_value = "sandcell-python")]
    kernel: String,
}

impl Kernel {
    /// Serves until a `shutdown_request`: status 0; status 2 with `sandcellctl kernel: ...`
    /// on standard error when the kernel cannot start (connection file, unknown kernel, a
    /// port that cannot be bound).
    pub async fn run(self, ctx: &Ctx) -> Outcome {
        match crate::jupyter::serve(ctx.socket.clone(), &self.connection_file, &self.kernel).await {
            Ok(()) => Ok(0),
            Err(e) => {
                errln!("sandcellctl kernel: {e}");
                Ok(2)
            }
        }
    }
}
