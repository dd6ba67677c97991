//! `sandcellctl mcp`: hands standard input and output to the MCP server ([`crate::mcp`]).

use super::{Ctx, Outcome};

/// Serves until standard input ends or SIGTERM or SIGINT arrives: status 0 (a second
/// signal: 128 + its number, at once); status 2 with `sandcellctl mcp: ...` on standard
/// error when the server fails.
pub async fn run(ctx: &Ctx) -> Outcome {
    match crate::mcp::serve(ctx.socket.clone()).await {
        Ok(crate::mcp::Ended::Eof) => Ok(0),
        // At once: the runtime's shutdown would wait for a blocking read of a terminal.
        Ok(crate::mcp::Ended::Signal) => std::process::exit(0),
        Err(e) => {
            errln!("sandcellctl mcp: {}", crate::mcp::describe_failure(&e));
            Ok(2)
        }
    }
}
