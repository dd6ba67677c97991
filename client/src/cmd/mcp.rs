//! `sandcellctl mcp`: hands standard input and output to the MCP server ([`crate::mcp`]).

use super::{Ctx, Outcome};

/// Serves until standard input ends: status 0; status 2 with `sandcellctl mcp: ...` on
/// standard error when the server fails.
pub async fn run(ctx: &Ctx) -> Outcome {
    match crate::mcp::serve(ctx.socket.clone()).await {
        Ok(()) => Ok(0),
        Err(e) => {
            errln!("sandcellctl mcp: {}", crate::mcp::describe_failure(&e));
            Ok(2)
        }
    }
}
