# sandcell R worker: the persistent R side of the daemon <-> worker protocol.
#
# Started by the `sandcell-worker-r` launcher (worker-native/src/r.rs) after confinement, as
#   R --vanilla --no-echo --no-restore --file=<this file>
# with this descriptor layout (proto/src/worker.rs):
#   fd 0  /dev/null
#   fd 1  the cells' stdout: a pipe the daemon drains and bounds (R output goes there directly)
#   fd 2  the cells' stderr: likewise
#   fd 3  requests: "<op> <cell> <len>[ key=value]...\n" followed by exactly <len> payload bytes
#   fd 4  replies: one JSON object per line (WorkerMessage: ready, then one done per exec,
#         echoing the request's nonce; R never sends output or dropped frames, and the
#         daemon ends a worker that does)
#
# R cannot wrap an inherited descriptor, so fds 3 and 4 are opened by path as
# /proc/self/fd/3 (mode "rb") and /proc/self/fd/4 (mode "ab": append, never truncate, in case
# fd 4 is ever a regular file). Each open makes a new open file description of the same pipe;
# Landlock does not govern pipes reached this way, but /proc must be mounted in the worker's
# view.
#
# Invariants kept here (each has a test in worker-native/tests/worker.rs):
# - Nothing of the worker lives in .GlobalEnv: the worker is evaluated (by the bootstrap line
#   below) in a private environment whose parent is baseenv(). Lookups from worker code therefore find base
#   functions before anything a cell defines. Generics the worker calls on the user's objects
#   (print of a visible value, conditionMessage) are called from a frame parented to
#   .GlobalEnv so S3 dispatch finds the user's methods there. The only other trace is the
#   attached `sandcell:guards` environment: quit(), q() and the two re-entry points.
# - Interrupts (SIGINT from the daemon) are suspended everywhere except around the cell's own
#   evaluation; a stale one is drained after a request is read and before the cell starts. A
#   SIGINT sent before the request was read is therefore discarded: the daemon repeats SIGINT
#   until the cell's `done` arrives.
# - The protocol connections survive closeAllConnections() and close(): they are checked and
#   reopened from the inherited descriptors before every use.
# - Outbound JSON is built by hand (jsonlite is never needed); numbers are integers formatted
#   with sprintf, never through OutDec; invalid UTF-8 is escaped byte by byte as the four
#   characters \xNN, as sandcell_proto::text::escape_lossy does.
# - Every string the worker reports is bounded: error message MAX_ERROR_MESSAGE bytes,
#   traceback MAX_TRACEBACK (innermost MAX_FRAMES frames), warnings MAX_WARNINGS of at most
#   MAX_ERROR_MESSAGE each and MAX_WARNING_TOTAL together, whole line MAX_WORKER_LINE.
# - A protocol violation by the daemon (malformed header, unknown op) ends the worker with
#   status 2 and a message on stderr; end of input on fd 3 or an `exit` request, status 0.
#
# An `inspect` request (Varlink Inspect) is not a cell: it lists the variables of .GlobalEnv
# (ls() order; not names starting with "." or "_") with their first class, object.size(),
# dim() and the first lines of str() (at most MAX_REPR_CHARS characters), in one `inspected`
# line of at most MAX_INSPECT_LINE bytes. It evaluates nothing at top level (.Last.value
# stays) and gives the user's code it may call (str, dim and format methods, promises,
# active bindings are not read) `timeout_ms` in all, with setTimeLimit() and interrupts
# allowed only there: an error shows <repr failed: class>, the call the budget (or the
# daemon's SIGINT) ends <repr timed out>, later values <repr skipped: time budget used up>.
#
# Host calls: host_call("name", list(...)) in a cell calls a tool of the client and returns
# its result (a list, from jsonlite::fromJSON(simplifyVector = FALSE)); the tool's error, a
# timeout, or a session without host_calls raise an error of class hostCallError. Only in a
# cell whose request says host_calls=1; the name (1 to 128 bytes of [A-Za-z0-9_.-]) and the
# arguments (a named list, at most 256 KiB of JSON from jsonlite::toJSON) are checked before
# one `host_call` line is sent (echoing the nonce, numbered per session from 1). The answer is
# the `host_reply` request naming that call; R cannot wait on a pipe interruptibly, so it is
# read by polling a second, non-blocking connection to fd 3 between short Sys.sleep()s, which
# the daemon's SIGINT and setTimeLimit() end. Nothing is buffered on the request connection
# ahead of it (while a cell runs the daemon writes only what the cell waits for: host
# replies and `displayed`); a `host_reply` naming another call (one given up on) is skipped,
# here and between requests. jsonlite must be installed (r-cran-jsonlite), else host_call
# raises.
#
# Rich output: a printed value's `display` line asks the daemon to answer `displayed` once it
# has read what R wrote to its raw pipes before it, and R waits for that answer (as for a host
# reply, interruptibly) before it evaluates on: R's console writes cannot be counted from R,
# and without the wait what the next expression prints could be read before the bundle.
#
# Visible top-level values are printed as the REPL prints them, unless the request says
# `display=0` (a gateway that wants print()-only semantics): then only explicit output shows.
#
# quit() and q() in a cell end the session: the worker reports `done` with status `exited`
# and the requested exit code, then exits with that status (R's own .Last and exit
# finalizers run when runLast = TRUE). base::quit() called directly still reports `exited`
# (without exit_code) through an exit finalizer.
#
# A jump to top level that bypasses every handler (a segfault R recognises as a C stack
# overflow, invokeRestart("abort")) is reported as an error of type `topLevelJump` and the
# session goes on, up to 16 times (see "recovery" near the end of the worker).

# Bootstrap. R's REPL re-parses an incomplete expression from its start each time it reads a
# line, so a 600-line local({...}) read by `R --file` costs a quadratic parse at start-up. This
# short expression instead reads the worker's source from the console (this very file, or the
# pipe the embedded copy arrives on) up to the end marker, parses it once and evaluates it in a
# private environment whose parent is baseenv().
local({
  src <- character(0)
  repeat {
    l <- readLines(stdin(), n = 1L)
    if (length(l) == 0L || identical(l, "## sandcell: end of worker")) break
    src[[length(src) + 1L]] <- l
  }
  eval(parse(text = src, keep.source = FALSE), envir = new.env(parent = baseenv()))
})

## ---- limits (keep in step with proto/src/worker.rs) -------------------------------------
MAX_WORKER_LINE <- 1024L * 1024L # bytes, newline excluded
MAX_ERROR_MESSAGE <- 16L * 1024L # bytes
MAX_TRACEBACK <- 32L * 1024L # bytes
MAX_CALL <- 4L * 1024L # bytes of the deparsed failing call
MAX_FRAME <- 512L # bytes of one deparsed traceback frame
MAX_FRAMES <- 100L # innermost traceback frames shown
MAX_WARNINGS <- 50L # warnings kept per cell
MAX_WARNING_TOTAL <- 128L * 1024L # bytes of all kept warnings of one cell
INSPECT_DEFAULT_ITEMS <- 100L # variables an inspect lists unless max_items says otherwise
INSPECT_MAX_ITEMS <- 1000L
MAX_VARIABLE_NAME <- 256L # bytes; longer names are left out (and `truncated` is set)
MAX_VARIABLE_TYPE <- 256L # bytes
MAX_REPR_CHARS <- 200L # characters, "..." included
MAX_SHAPE_DIMS <- 64L
MAX_INSPECT_LINE <- 512L * 1024L # bytes of one `inspected` line
MAX_HOST_CALL_NAME <- 128L # bytes of [A-Za-z0-9_.-]
MAX_HOST_CALL_ARGUMENTS <- 256L * 1024L # bytes of JSON
MAX_HEADER_LINE <- 256L # bytes of a request header
IN_PATH <- "/proc/self/fd/3"
OUT_PATH <- "/proc/self/fd/4"

state <- new.env(parent = emptyenv())
state$inp <- NULL # request connection
state$out <- NULL # reply connection
state$cell <- NULL # id (digits, as text) of the running cell, NULL between cells
state$nonce <- NULL # the running request's nonce (16 hex digits), echoed in its `done`
state$done_sent <- FALSE
state$warnings <- character(0)
state$host_calls <- FALSE # the running cell may make host calls
state$host_seq <- 0 # id of the session's last host call
state$host_busy <- FALSE

## ---- text: bounding and escaping -----------------------------------------------------

# Escapes the bytes `b` (raw) into valid UTF-8 text, every byte of an invalid sequence
# becoming the four characters \xNN, and stops before the text would exceed `budget` bytes.
# Returns list(text = character(1), used = number of input bytes consumed). A loop over
# bytes: only reached for text that is not valid UTF-8, at most a few times MAX bytes.
escape_bytes <- function(b, budget) {
  n <- length(b)
  v <- as.integer(b)
  out <- character(0)
  size <- 0L
  i <- 1L
  run_start <- 1L # start of the current run of valid bytes
  flush_run <- function(upto) {
    if (upto >= run_start) out[[length(out) + 1L]] <<- rawToChar(b[run_start:upto])
  }
  while (i <= n) {
    x <- v[[i]]
    need <- if (x < 0x80L) {
      1L
    } else if (x >= 0xC2L && x <= 0xDFL) {
      2L
    } else if (x >= 0xE0L && x <= 0xEFL) {
      3L
    } else if (x >= 0xF0L && x <= 0xF4L) {
      4L
    } else {
      0L
    }
    ok <- need > 0L && i + need - 1L <= n
    if (ok && need > 1L) {
      y <- v[[i + 1L]]
      lo <- 0x80L
      hi <- 0xBFL
      if (x == 0xE0L) lo <- 0xA0L
      if (x == 0xEDL) hi <- 0x9FL
      if (x == 0xF0L) lo <- 0x90L
      if (x == 0xF4L) hi <- 0x8FL
      ok <- y >= lo && y <= hi
      if (ok && need > 2L) {
        rest <- v[(i + 2L):(i + need - 1L)]
        ok <- all(rest >= 0x80L & rest <= 0xBFL)
      }
    }
    unit <- if (ok) need else 4L # output bytes of this unit
    if (size + unit > budget) break
    size <- size + unit
    if (ok) {
      i <- i + need
    } else {
      flush_run(i - 1L)
      out[[length(out) + 1L]] <- sprintf("\\x%02x", x)
      i <- i + 1L
      run_start <- i
    }
  }
  flush_run(i - 1L)
  txt <- paste(out, collapse = "")
  Encoding(txt) <- "UTF-8"
  list(text = txt, used = i - 1L)
}

more_marker <- function(n) sprintf("... [%.0f more bytes]", as.numeric(n))

# Makes `s` (any R string, any declared encoding) safe for the wire: valid UTF-8, invalid
# bytes escaped as \xNN, at most `max` bytes of text plus a marker "... [N more bytes]"
# counting the original bytes that were cut (as sandcell_proto::worker::bound_text). Never
# copies more than about 4 * max bytes of a huge input.
bound_text <- function(s, max) {
  if (length(s) == 0L || is.na(s[[1L]])) return("NA")
  s <- s[[1L]]
  if (identical(Encoding(s), "latin1")) s <- tryCatch(enc2utf8(s), error = function(e) s)
  total <- nchar(s, type = "bytes")
  if (total > max) {
    # substr counts characters (>= bytes / 4); it fails on invalid UTF-8, in which case the
    # bytes are reached through a "bytes"-encoded copy.
    head <- tryCatch(substr(s, 1L, max), error = function(e) NULL)
    if (is.null(head)) {
      t <- s
      Encoding(t) <- "bytes"
      head <- substr(t, 1L, max)
    }
    b <- charToRaw(head)
    if (length(b) > max) b <- b[seq_len(max)]
  } else {
    b <- charToRaw(s)
  }
  # Fast path: valid UTF-8 (after dropping a character the cut may have split).
  for (drop in 0:3) {
    if (drop > 0L && (total <= max || drop >= length(b))) break
    head <- rawToChar(b[seq_len(length(b) - drop)])
    if (validUTF8(head)) {
      Encoding(head) <- "UTF-8"
      used <- length(b) - drop
      return(if (used < total) paste0(head, more_marker(total - used)) else head)
    }
  }
  r <- escape_bytes(b, max)
  if (r$used < total) paste0(r$text, more_marker(total - r$used)) else r$text
}

CONTROL_CODES <- c(1:7, 11L, 14:31)
CONTROL <- vapply(CONTROL_CODES, function(i) rawToChar(as.raw(i)), "")
CONTROL_ESC <- sprintf("\\u%04x", CONTROL_CODES)

# JSON string literals (quotes included) for texts that bound_text() already made valid
# UTF-8 (vectorised). Byte-wise replacements of ASCII are exact on UTF-8 text.
json_str <- function(s) {
  s <- gsub("\\", "\\\\", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\"", "\\\"", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\n", "\\n", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\r", "\\r", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\t", "\\t", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\b", "\\b", s, fixed = TRUE, useBytes = TRUE)
  s <- gsub("\f", "\\f", s, fixed = TRUE, useBytes = TRUE)
  if (any(grepl("[\001-\037]", s, useBytes = TRUE))) {
    for (k in seq_along(CONTROL)) {
      s <- gsub(CONTROL[[k]], CONTROL_ESC[[k]], s, fixed = TRUE, useBytes = TRUE)
    }
  }
  paste0("\"", s, "\"")
}

# An integer as JSON, never through OutDec or scientific notation.
json_int <- function(x) sprintf("%.0f", as.numeric(x))

# One JSON object from a named list of already encoded JSON values (NULLs are left out).
json_obj <- function(fields) {
  fields <- fields[!vapply(fields, is.null, TRUE)]
  paste0("{", paste0(json_str(names(fields)), ":", unlist(fields), collapse = ","), "}")
}

## ---- protocol connections ----------------------------------------------------------

# The daemon broke the protocol (or a reply cannot be sent): say why on stderr and end the
# worker. Never stop(): with options(error) set for recovery (below), an error reaching top
# level would resume the loop on a desynchronised stream.
protocol_fail <- function(msg) {
  tryCatch(cat("sandcell worker: protocol error:", msg, "\n", file = stderr()),
    error = function(e) NULL)
  base::quit(save = "no", status = 2L, runLast = FALSE)
}

# TRUE when `con` is still the connection we opened (not closed, and its slot not reused by
# a connection a cell opened after closeAllConnections()).
con_ok <- function(con) {
  if (is.null(con)) return(FALSE)
  tryCatch({
    cur <- getConnection(as.integer(con))
    identical(attr(cur, "conn_id"), attr(con, "conn_id")) && isOpen(cur)
  }, error = function(e) FALSE)
}

input <- function() {
  if (!con_ok(state$inp)) state$inp <- file(IN_PATH, open = "rb", raw = TRUE)
  state$inp
}

output <- function() {
  if (!con_ok(state$out)) state$out <- file(OUT_PATH, open = "ab", raw = TRUE)
  state$out
}

# Writes one reply line. A line over MAX_WORKER_LINE is never sent (the daemon would end
# the worker); callers shrink their message first, this is the last guard.
send_line <- function(line) {
  b <- charToRaw(line)
  if (length(b) > MAX_WORKER_LINE) protocol_fail("reply line too long")
  con <- output()
  writeBin(c(b, as.raw(10L)), con)
  flush(con)
  invisible(NULL)
}

# Reads one request. Returns NULL at end of input, else
# list(op = "exec"|"exit"|other, cell = digits as text, payload = raw, opts = named list).
read_request <- function() {
  con <- input()
  hdr <- readLines(con, n = 1L, warn = FALSE)
  if (length(hdr) == 0L) return(NULL)
  parts <- strsplit(hdr, " ", fixed = TRUE)[[1L]]
  if (length(parts) < 3L || !grepl("^[0-9]+$", parts[[2L]]) ||
    !grepl("^[0-9]+$", parts[[3L]])) {
    protocol_fail(paste("malformed request header:", substr(hdr, 1L, 256L)))
  }
  len <- as.numeric(parts[[3L]])
  if (len > .Machine$integer.max) protocol_fail("request payload too large")
  opts <- list()
  for (kv in parts[-(1:3)]) {
    k <- sub("=.*$", "", kv)
    v <- sub("^[^=]*=", "", kv)
    if (identical(k, "nonce")) {
      # Kept as text (64 bits do not fit a double); echoed in this request's `done`.
      if (!grepl("^[0-9a-f]{16}$", v)) protocol_fail("malformed nonce")
      opts$nonce <- v
    } else if (grepl("^[0-9]+$", v)) {
      opts[[k]] <- as.numeric(v)
    }
  }
  payload <- if (len > 0) readBin(con, "raw", n = as.integer(len)) else raw(0)
  if (length(payload) < len) return(NULL)
  list(op = parts[[1L]], cell = parts[[2L]], payload = payload, opts = opts)
}

## ---- host calls ----------------------------------------------------------------------

host_call_error <- function(msg) {
  structure(class = c("hostCallError", "error", "condition"),
    list(message = bound_text(msg, MAX_ERROR_MESSAGE), call = NULL))
}

# Waits for the request that `wanted(parts)` accepts (`parts`: its header's fields) and
# returns its payload: polls a non-blocking connection to fd 3, sleeping between reads from
# `pause` seconds up (interruptible: the daemon's SIGINT and the cell's time limit end the
# wait). During a cell the daemon sends only `host_reply` and `displayed`; one not wanted is
# stale (an answer to a call given up on, a `displayed` from a daemon that continued the cell
# after a restart) and skipped. Bytes after a wanted `host_reply` break the protocol; after a
# wanted `displayed`, only another stale `displayed` can follow, and it is dropped.
request_wait <- function(wanted, pause) {
  con <- file(IN_PATH, open = "rb", blocking = FALSE, raw = TRUE)
  on.exit(close(con))
  buf <- raw(0)
  first <- pause
  repeat {
    nl <- match(as.raw(10L), buf)
    if (is.na(nl) && length(buf) > MAX_HEADER_LINE) protocol_fail("request header too long")
    if (!is.na(nl)) {
      parts <- strsplit(rawToChar(buf[seq_len(nl - 1L)]), " ", fixed = TRUE)[[1L]]
      if (length(parts) < 3L || !(parts[[1L]] %in% c("host_reply", "displayed")) ||
        !grepl("^[0-9]+$", parts[[3L]])) {
        protocol_fail("unexpected request while the worker waits")
      }
      end <- nl + as.numeric(parts[[3L]])
      if (length(buf) >= end) {
        payload <- buf[seq.int(nl + 1L, length.out = end - nl)]
        buf <- buf[-seq_len(end)]
        if (wanted(parts)) {
          if (length(buf) && identical(parts[[1L]], "host_reply")) {
            protocol_fail("bytes after a host reply")
          }
          return(payload)
        }
        next
      }
    }
    chunk <- readBin(con, "raw", n = 65536L)
    if (length(chunk)) {
      buf <- c(buf, chunk)
      pause <- first
    } else {
      Sys.sleep(pause)
      pause <- min(pause * 2, 0.02)
    }
  }
}

# The payload of the `host_reply` naming `call`.
host_wait <- function(call) {
  want <- paste0("call=", json_int(call))
  request_wait(function(parts) identical(parts[[1L]], "host_reply") && want %in% parts[-(1:3)],
    0.0005)
}

# host_call() as the cells see it.
host_call <- function(name, arguments = list()) {
  if (!is.character(name) || length(name) != 1L || is.na(name) ||
    !grepl("^[A-Za-z0-9_.-]+$", name) || nchar(name, type = "bytes") > MAX_HOST_CALL_NAME) {
    stop(host_call_error(sprintf(
      "a host call's name is 1 to %d characters of [A-Za-z0-9_.-]", MAX_HOST_CALL_NAME)))
  }
  if (!is.list(arguments) || (length(arguments) > 0L &&
    (is.null(names(arguments)) || any(!nzchar(names(arguments)))))) {
    stop(host_call_error("a host call's arguments are a named list"))
  }
  if (is.null(state$cell) || !isTRUE(state$host_calls)) {
    stop(host_call_error("host calls are not enabled for this session (open it with host_calls)"))
  }
  if (isTRUE(state$host_busy)) stop(host_call_error("another host call waits for its answer"))
  if (!requireNamespace("jsonlite", quietly = TRUE)) {
    stop(host_call_error("host_call needs the jsonlite package"))
  }
  args <- if (length(arguments) == 0L) "{}" else
    as.character(jsonlite::toJSON(arguments, auto_unbox = TRUE, null = "null", digits = NA))
  if (nchar(args, type = "bytes") > MAX_HOST_CALL_ARGUMENTS) {
    stop(host_call_error(sprintf("a host call's arguments are at most %d bytes of JSON",
      MAX_HOST_CALL_ARGUMENTS)))
  }
  state$host_busy <- TRUE
  on.exit(state$host_busy <- FALSE)
  state$host_seq <- state$host_seq + 1
  call <- state$host_seq
  line <- paste0("{\"t\":\"host_call\",\"cell\":", state$cell,
    if (!is.null(state$nonce)) paste0(",\"nonce\":", json_str(state$nonce)),
    ",\"call\":", json_int(call), ",\"name\":", json_str(name), ",\"arguments\":", args, "}")
  suspendInterrupts(send_line(line))
  payload <- host_wait(call)
  answer <- jsonlite::fromJSON(rawToChar(payload), simplifyVector = FALSE)
  if (!is.null(answer$error)) stop(host_call_error(as.character(answer$error)))
  answer$result
}

## ---- replies -----------------------------------------------------------------------

send_ready <- function() {
  engine <- paste0("R ", R.version$major, ".", R.version$minor)
  send_line(json_obj(list(t = json_str("ready"), language = json_str("r"),
    engine = json_str(engine))))
}

# r: list(status, error = list(type, message, traceback, line, call) or NULL,
#         exit_code, warnings = character)
send_done <- function(cell, r) {
  enc_error <- function(e, tb) {
    if (is.null(e)) return(NULL)
    json_obj(list(
      type = json_str(bound_text(e$type, 256L)),
      message = json_str(e$message), # bounded by whoever built `e`
      traceback = if (tb && !is.null(e$traceback)) json_str(e$traceback),
      line = if (!is.null(e$line)) json_int(e$line),
      call = if (!is.null(e$call)) json_str(e$call)
    ))
  }
  build <- function(warnings, tb) {
    json_obj(list(
      t = json_str("done"),
      cell = cell,
      nonce = if (!is.null(state$nonce)) json_str(state$nonce),
      status = json_str(r$status),
      error = enc_error(r$error, tb),
      exit_code = if (!is.null(r$exit_code)) json_int(r$exit_code),
      state = json_str("kept"),
      warnings = if (length(warnings)) paste0("[", paste(json_str(warnings), collapse = ","), "]")
    ))
  }
  line <- build(r$warnings, TRUE)
  if (nchar(line, type = "bytes") > MAX_WORKER_LINE) {
    line <- build(sprintf("%d warnings not kept: reply too large", length(r$warnings)), FALSE)
  }
  if (nchar(line, type = "bytes") > MAX_WORKER_LINE) {
    r$error$message <- "error report too large to send"
    line <- build(character(0), FALSE)
  }
  send_line(line)
  state$done_sent <- TRUE
}

## ---- the cell --------------------------------------------------------------------

# Drops a pending SIGINT that arrived while no cell was running (Sys.sleep checks for one
# deterministically; a for loop or an empty expression does not). Sys.sleep(0) polls without
# sleeping: any positive time gives up the CPU before every cell, and on a busy machine the
# worker then waits for the scheduler before it can run the cell.
drain_interrupt <- function() {
  tryCatch(allowInterrupts(Sys.sleep(0)), interrupt = function(e) NULL)
  invisible(NULL)
}

# Restores the output routing a cell may have changed (sink(), closeAllConnections()).
reset_io <- function() {
  tryCatch(while (sink.number() > 0L) sink(), error = function(e) NULL)
  tryCatch(if (sink.number(type = "message") != 2L) sink(type = "message"),
    error = function(e) NULL)
  tryCatch(flush(stdout()), error = function(e) NULL)
}

# First line of a srcref, or NULL.
srcref_line <- function(sr) {
  if (is.null(sr) || length(sr) < 1L) return(NULL)
  as.integer(sr[[1L]])
}

# The worker's own eval() of a top-level expression (run_exprs) as it appears in
# sys.calls() and as the conditionCall() of an error raised directly at top level.
is_cell_eval <- function(cl) {
  is.call(cl) && identical(cl[[1L]], quote(eval)) && length(cl) >= 2L &&
    identical(cl[[2L]], quote(sandcell_cell_expr))
}

is_handler_frame <- function(cl) {
  is.call(cl) && identical(cl[[1L]], quote(.handleSimpleError))
}

deparse_bounded <- function(x, max) {
  d <- tryCatch(deparse(x, width.cutoff = 200L, nlines = 8L), error = function(e) "<call>")
  bound_text(paste(d, collapse = "\n"), max)
}

# Calling handler for every error signalled while the cell runs: records the call stack at
# the point of the error so that the exiting handler can report the line and traceback of
# the error that actually escaped the cell.
capture_error <- function(cond) {
  # Near C stack exhaustion, R runs handlers on the little stack left: record nothing.
  if (inherits(cond, "CStackOverflowError")) return(invisible())
  calls <- sys.calls()
  calls <- calls[seq_len(length(calls) - 1L)] # drop this handler's own frame
  state$captured <- list(cond = cond, calls = calls, srcfile = state$srcfile)
}

# The error report (list(type, message, line, call, traceback)) for `cond`.
describe_error <- function(cond) {
  msg <- message_of(cond)
  if (!is.character(msg) || length(msg) == 0L) msg <- "<no message>"
  # Bounded at once: everything after this (pattern matching included) sees at most
  # MAX_ERROR_MESSAGE bytes, whatever the cell raised.
  msg <- bound_text(msg[[1L]], MAX_ERROR_MESSAGE)
  type <- tryCatch(class(cond)[[1L]], error = function(e) "error")
  call <- tryCatch(conditionCall(cond), error = function(e) NULL)
  if (is_cell_eval(call) || !is.call(call)) call <- NULL
  line <- state$expr_line
  tb <- NULL
  cap <- state$captured
  if (!is.null(cap) && identical(cap$cond, cond)) {
    calls <- cap$calls
    ev <- 0L
    for (k in seq_along(calls)) if (is_cell_eval(calls[[k]])) ev <- k
    found <- FALSE
    frames <- character(0)
    skipped <- 0L
    for (k in rev(seq_along(calls))) {
      if (k <= ev) break
      sr <- attr(calls[[k]], "srcref")
      here <- !is.null(sr) && identical(attr(sr, "srcfile"), cap$srcfile)
      if (here && !found) {
        line <- srcref_line(sr) # innermost position inside this cell
        found <- TRUE
      }
      if (!is_handler_frame(calls[[k]]) && length(frames) >= MAX_FRAMES) {
        skipped <- skipped + 1L
      } else if (!is_handler_frame(calls[[k]])) {
        where <- if (here) {
          sprintf(" at line %d", srcref_line(sr))
        } else if (!is.null(sr)) {
          f <- tryCatch(attr(sr, "srcfile")$filename, error = function(e) NULL)
          if (is.character(f) && length(f) == 1L) sprintf(" at %s:%d", f, srcref_line(sr)) else ""
        } else {
          ""
        }
        frames <- c(frames, paste0(length(frames) + 1L, ": ",
          deparse_bounded(calls[[k]], MAX_FRAME), where))
      }
    }
    if (skipped > 0L) frames <- c(frames, sprintf("... %d outer frames not shown", skipped))
    if (length(frames)) tb <- bound_text(paste(frames, collapse = "\n"), MAX_TRACEBACK)
  }
  list(type = type, message = msg, line = line,
    call = if (!is.null(call)) deparse_bounded(call, MAX_CALL), traceback = tb)
}

is_memory_error <- function(msg) {
  grepl("^cannot allocate (vector|memory)|vector memory (exhausted|limit)|memory exhausted",
    msg, useBytes = TRUE)
}

add_warning <- function(cond) {
  if (length(state$warnings) >= MAX_WARNINGS) {
    state$warnings_dropped <- state$warnings_dropped + 1L
    return(invisible())
  }
  msg <- message_of(cond)
  if (!is.character(msg) || length(msg) == 0L) msg <- "<no message>"
  call <- tryCatch(conditionCall(cond), error = function(e) NULL)
  if (is_cell_eval(call)) call <- NULL
  text <- if (is.call(call)) {
    paste0("In ", deparse_bounded(call, 256L), " : ", bound_text(msg, MAX_ERROR_MESSAGE))
  } else {
    bound_text(msg, MAX_ERROR_MESSAGE)
  }
  size <- nchar(text, type = "bytes")
  if (state$warnings_size + size > MAX_WARNING_TOTAL) {
    state$warnings_dropped <- state$warnings_dropped + 1L
    return(invisible())
  }
  state$warnings_size <- state$warnings_size + size
  state$warnings <- c(state$warnings, text)
}

# Calls generic `fun` (a symbol) on `x` from a frame whose parent is .GlobalEnv, so that S3
# dispatch finds the user's methods there (from the worker's own environment it would not:
# method lookup stops at baseenv(), the worker environment's top). `print` is looked up as
# the REPL looks it up, from .GlobalEnv; other generics are taken from base.
call_in_global <- function(fun, x) {
  eval(as.call(list(fun, quote(x))), list(x = x), .GlobalEnv)
}

# Prints a visible value as the REPL does (S4 objects with show()).
print_value <- function(value) {
  if (isS4(value)) methods::show(value) else call_in_global(quote(print), value)
}

message_of <- function(cond) {
  tryCatch(call_in_global(quote(base::conditionMessage), cond),
    error = function(e) "<conditionMessage failed>")
}

# Most bytes of printed text one R display bundle carries (escaped, it stays far under the
# 512 KiB bundle cap and the 1 MiB reply line).
MAX_DISPLAY_TEXT <- 128L * 1024L

# Rows and columns of a data frame or matrix shown in its text/html table (IRkernel's repr
# shows 60 rows and 20 columns by default: repr.matrix.max.rows / max.cols); the rest is
# counted in the caption.
MAX_HTML_ROWS <- 60L
MAX_HTML_COLS <- 20L

html_escape <- function(x) {
  x <- gsub("&", "&amp;", x, fixed = TRUE)
  x <- gsub("<", "&lt;", x, fixed = TRUE)
  x <- gsub(">", "&gt;", x, fixed = TRUE)
  gsub("\"", "&quot;", x, fixed = TRUE)
}

# The text/html table of a data frame or matrix `v` (at most MAX_HTML_ROWS x MAX_HTML_COLS
# cells, each formatted as print would); NULL for any other value, or when formatting fails
# or the table would pass MAX_DISPLAY_TEXT (the bundle then has its text/plain only).
html_table <- function(v) {
  if (!(is.data.frame(v) || is.matrix(v))) return(NULL)
  tryCatch({
    nr <- NROW(v)
    nc <- NCOL(v)
    if (nc == 0L || nc > 100000L) return(NULL)
    part <- v[seq_len(min(nr, MAX_HTML_ROWS)), seq_len(min(nc, MAX_HTML_COLS)), drop = FALSE]
    # base's own formatting, as a character matrix of the shown cells (a tibble's format
    # method returns printed lines instead).
    cells <- if (is.data.frame(part)) {
      as.matrix(base::format.data.frame(base::as.data.frame(part)))
    } else {
      base::format.default(part)
    }
    cn <- colnames(part)
    if (is.null(cn)) cn <- sprintf("[,%d]", seq_len(ncol(cells)))
    rn <- rownames(part)
    if (is.null(rn)) rn <- sprintf("[%d,]", seq_len(nrow(cells)))
    if (!is.matrix(cells) || length(cn) != ncol(cells) || length(rn) != nrow(cells)) {
      return(NULL)
    }
    kind <- if (is.data.frame(v)) "A data.frame" else "A matrix"
    caption <- sprintf("%s: %d &times; %d", kind, nr, nc)
    if (nr > nrow(cells) || nc > ncol(cells)) {
      caption <- sprintf("%s (first %d rows, %d columns shown)", caption, nrow(cells), ncol(cells))
    }
    head <- paste0("<tr><th></th>", paste0("<th>", html_escape(cn), "</th>", collapse = ""), "</tr>")
    body <- vapply(seq_len(nrow(cells)), function(i) {
      paste0("<tr><th>", html_escape(rn[[i]]), "</th>",
        paste0("<td>", html_escape(cells[i, ]), "</td>", collapse = ""), "</tr>")
    }, "")
    html <- paste0("<table class=\"dataframe\">\n<caption>", caption, "</caption>\n<thead>",
      head, "</thead>\n<tbody>\n", paste(body, collapse = "\n"), "\n</tbody>\n</table>")
    if (nchar(html, type = "bytes") > MAX_DISPLAY_TEXT) NULL else html
  }, error = function(e) NULL)
}

# Sends a printed value as a `display` line (rich output): kind "result" for the cell's last
# expression, "display" for an earlier one; nothing when printing wrote no text (a plot).
# `html`: the value's text/html (a data frame's or matrix's table), or NULL.
send_printed <- function(text, last, html = NULL) {
  if (!length(text)) return(invisible(NULL))
  s <- paste(text, collapse = "\n")
  if (!nzchar(s)) return(invisible(NULL))
  s <- bound_text(s, MAX_DISPLAY_TEXT)
  flush(stdout())
  extra <- if (is.null(html)) "" else paste0(",\"text/html\":", json_str(html))
  # `wait`: R cannot count what its console writes to the raw pipes, so it waits until the
  # daemon has read them and placed the bundle; what the cell prints next follows it.
  line <- paste0("{\"t\":\"display\",\"cell\":", json_int(state$cell),
    ",\"kind\":", json_str(if (last) "result" else "display"),
    ",\"data\":{\"text/plain\":", json_str(s), extra, "},\"wait\":true}")
  suspendInterrupts(send_line(line))
  request_wait(function(parts) identical(parts[[1L]], "displayed"), 0.0001)
  invisible(NULL)
}

# Evaluates the parsed cell expression by expression in .GlobalEnv, printing visible values
# (unless `display` is FALSE) and flushing stdout after each one (R also flushes after every
# console write). With `rich`, a visible value's printed text goes out as a display bundle
# (text/plain) instead of stdout.
run_exprs <- function(exprs, display, rich = FALSE) {
  srefs <- attr(exprs, "srcref")
  for (i in seq_along(exprs)) {
    sandcell_cell_expr <- exprs[i]
    attr(sandcell_cell_expr, "srcref") <- srefs[i]
    state$expr_line <- srcref_line(srefs[[i]])
    r <- withVisible(eval(sandcell_cell_expr, .GlobalEnv))
    if (display && r$visible) {
      if (rich) {
        send_printed(utils::capture.output(print_value(r$value)), i == length(exprs),
          html_table(r$value))
      } else {
        print_value(r$value)
      }
    }
    flush(stdout())
  }
}

# Runs one cell; returns the list send_done() expects.
run_cell <- function(cell, payload, opts) {
  state$cell <- cell
  state$warnings <- character(0)
  state$warnings_size <- 0L
  state$warnings_dropped <- 0L
  state$captured <- NULL
  state$expr_line <- NULL
  if (any(payload == as.raw(0L))) {
    return(list(status = "error", error = list(type = "parseError",
      message = "the cell's source contains a NUL byte")))
  }
  code <- rawToChar(payload)
  Encoding(code) <- "UTF-8"
  fname <- paste0("<cell", cell, ">")
  sf <- srcfilecopy(fname, code)
  state$srcfile <- sf
  exprs <- tryCatch(parse(text = code, keep.source = TRUE, srcfile = sf),
    error = function(e) e)
  if (inherits(exprs, "error")) {
    # R quotes the offending source line: bounded like any message.
    msg <- bound_text(conditionMessage(exprs), MAX_ERROR_MESSAGE)
    m <- regmatches(msg, regexec(paste0("^<cell[0-9]+>:([0-9]+):"), msg))[[1L]]
    return(list(status = "error", error = list(type = "parseError", message = msg,
      line = if (length(m) == 2L) as.integer(m[[2L]]))))
  }
  timeout <- opts[["timeout_ms"]]
  limited <- is.numeric(timeout) && timeout > 0
  r <- tryCatch({
    withCallingHandlers({
      if (limited) setTimeLimit(elapsed = timeout / 1000, transient = FALSE)
      allowInterrupts(run_exprs(exprs, !identical(opts[["display"]], 0),
        identical(opts[["rich"]], 1)))
      list(status = "ok")
    }, warning = function(w) {
      lvl <- getOption("warn")
      lvl <- if (is.numeric(lvl) && length(lvl) == 1L && !is.na(lvl)) lvl else 0
      if (lvl >= 2) return(invisible()) # R turns it into an error
      if (lvl >= 0) add_warning(w)
      invokeRestart("muffleWarning")
    }, error = capture_error)
  }, interrupt = function(e) {
    list(status = "interrupted")
  }, error = function(e) {
    err <- describe_error(e)
    status <- if (is_memory_error(err$message)) {
      "memory_exhausted"
    } else if (limited && identical(err$message, "reached elapsed time limit")) {
      "timeout"
    } else {
      "error"
    }
    list(status = status, error = err)
  })
  # The REPL drops transient time limits (setTimeLimit()'s default) when it returns to the
  # prompt; this loop never returns there, so every limit ends with its cell.
  setTimeLimit()
  state$captured <- NULL
  if (state$warnings_dropped > 0L) {
    state$warnings <- c(state$warnings,
      sprintf("[%d more warnings not kept]", state$warnings_dropped))
  }
  r$warnings <- state$warnings
  r
}

## ---- plots ------------------------------------------------------------------------
#
# A cell that draws with base graphics without opening a device gets PNG files: the default
# device of each cell writes plot-<cell>-001.png, -002.png, ... (one per page) into the
# session directory. Devices the cell opened (ours or its own) are closed after it, so every
# file is complete before `done`, and the daemon reports it in the cell's `files`.

SESSION_DIR <- local({
  d <- Sys.getenv("SANDCELL_SESSION_DIR", "")
  if (!nzchar(d)) d <- getwd()
  d
})

MAX_PLOT_SIDE <- 5000

# Sets the default device for `cell` (digits, as text); returns the devices open before.
# Its size follows IRkernel's options where the cell set them: repr.plot.width and
# repr.plot.height in inches, repr.plot.res in pixels per inch (IRkernel's defaults 7, 7 and
# 120); without them, png()'s own 480 x 480 pixels. Numbers outside 0.5-50 inches or 36-600
# ppi are ignored, and the resolution is lowered to keep each side within MAX_PLOT_SIDE
# pixels.
plot_device_begin <- function(cell) {
  pattern <- file.path(SESSION_DIR, sprintf("plot-%s-%%03d.png", cell))
  opt <- function(name, default, lo, hi) {
    v <- getOption(name)
    if (is.numeric(v) && length(v) == 1L && !is.na(v) && v >= lo && v <= hi) v else default
  }
  # Read when the device opens (the cell's first plot), after the cell set its options.
  options(device = function(...) {
    sized <- !is.null(getOption("repr.plot.width")) ||
      !is.null(getOption("repr.plot.height")) || !is.null(getOption("repr.plot.res"))
    if (!sized) return(grDevices::png(filename = pattern, ...))
    w <- opt("repr.plot.width", 7, 0.5, 50)
    h <- opt("repr.plot.height", 7, 0.5, 50)
    # At most MAX_PLOT_SIDE pixels a side (the resolution lowered to fit): the device's
    # bitmap is width x height x 4 bytes of the session's memory.
    res <- min(opt("repr.plot.res", 120, 36, 600), MAX_PLOT_SIDE / max(w, h))
    grDevices::png(filename = pattern, width = w, height = h, units = "in", res = res, ...)
  })
  grDevices::dev.list()
}

# Closes every device opened since plot_device_begin() returned `before`.
plot_device_end <- function(before) {
  opened <- setdiff(as.integer(grDevices::dev.list()), as.integer(before))
  for (d in opened) tryCatch(grDevices::dev.off(d), error = function(e) NULL)
  invisible(NULL)
}

# With rich output (`rich=1`), each page the default device wrote for the cell also goes out
# as an image/png display bundle, in page order, after everything the cell printed (as
# matplotlib figures left open do in the Python engines); the files stay as without it. A
# bundle whose JSON would pass MAX_DISPLAY_BYTES is sent as its text/plain with a note (an
# image is never cut), and past MAX_PLOTS pages one text bundle says how many more there are.
# Figures drawn on a device the cell opened itself (png("x.png")) are the cell's own files.

MAX_DISPLAY_BYTES <- 512L * 1024L # keep in step with sandcell_proto::kernel::MAX_DISPLAY_BYTES
MAX_PLOTS <- 100L # pages of one cell sent as bundles
PNG_SIGNATURE <- as.raw(c(0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a))
B64 <- charToRaw("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")

# Standard base64 (RFC 4648, padded) of raw `r`, vectorised: whole 3-byte groups become
# 4 alphabet indices at once.
base64_raw <- function(r) {
  n <- length(r)
  if (n == 0L) return("")
  pad <- (3L - n %% 3L) %% 3L
  m <- matrix(c(as.integer(r), integer(pad)), nrow = 3L)
  x <- m[1L, ] * 65536L + m[2L, ] * 256L + m[3L, ]
  idx <- rbind(x %/% 262144L, (x %/% 4096L) %% 64L, (x %/% 64L) %% 64L, x %% 64L) + 1L
  out <- B64[idx]
  if (pad > 0L) out[(length(out) - pad + 1L):length(out)] <- charToRaw("=")
  rawToChar(out)
}

# Sends the `display` line of one bundle (`fields`: named list of encoded JSON values).
send_bundle_line <- function(fields, note = NULL) {
  flush(stdout())
  line <- paste0("{\"t\":\"display\",\"cell\":", json_int(state$cell),
    ",\"kind\":\"display\",\"data\":", json_obj(fields),
    if (!is.null(note)) paste0(",\"note\":", json_str(note)), "}")
  suspendInterrupts(send_line(line))
}

# The bundle of one page `name` (a regular file in the session directory): text/plain names
# it with its size in pixels (from the PNG header), image/png is the file in base64.
send_plot <- function(name) {
  path <- file.path(SESSION_DIR, name)
  if (!isTRUE(utils::file_test("-f", path))) return(invisible(NULL)) # never a FIFO or a directory
  size <- file.size(path)
  if (is.na(size) || size < 24) return(invisible(NULL))
  con <- file(path, open = "rb")
  on.exit(close(con))
  head <- readBin(con, "raw", n = 24L)
  if (!identical(head[1:8], PNG_SIGNATURE)) return(invisible(NULL))
  be32 <- function(b) sum(as.numeric(as.integer(b)) * 256^(3:0))
  text <- sprintf("<R plot %.0fx%.0f: %s>", be32(head[17:20]), be32(head[21:24]), name)
  fields <- list(`text/plain` = json_str(text))
  # Exact bytes of the bundle's JSON: the text part, `,"image/png":""`, the base64 digits.
  total <- nchar(json_obj(fields), type = "bytes") + 15 + 4 * ceiling(size / 3)
  if (total > MAX_DISPLAY_BYTES) {
    return(send_bundle_line(fields, sprintf(
      "bundle of %.0f bytes over the %d-byte cap: text/plain only", total, MAX_DISPLAY_BYTES)))
  }
  png <- c(head, readBin(con, "raw", n = as.integer(size)))
  fields$`image/png` <- paste0("\"", base64_raw(png), "\"")
  send_bundle_line(fields)
}

# Sends the pages the default device wrote for `cell` (digits, as text), in page order.
send_plots <- function(cell) {
  names <- list.files(SESSION_DIR, pattern = sprintf("^plot-%s-[0-9]+[.]png$", cell))
  if (!length(names)) return(invisible(NULL))
  page <- as.numeric(sub("^plot-[0-9]+-([0-9]+)[.]png$", "\\1", names))
  names <- names[order(page)]
  for (name in utils::head(names, MAX_PLOTS)) {
    tryCatch(send_plot(name), error = function(e) NULL)
  }
  if (length(names) > MAX_PLOTS) {
    send_bundle_line(list(`text/plain` = json_str(sprintf(
      "[%d more plots saved as files, not shown]", length(names) - MAX_PLOTS))))
  }
  invisible(NULL)
}

## ---- inspect ----------------------------------------------------------------------

# Calls fun() (the user's code) with the inspect's time left before st$deadline (elapsed
# seconds): list(status = "ok", value), "error" (with class) or "budget" (the time limit,
# an interrupt, or no time left).
inspect_call <- function(st, fun) {
  left <- st$deadline - proc.time()[["elapsed"]]
  if (left <= 0) return(list(status = "budget"))
  setTimeLimit(elapsed = left, transient = FALSE)
  on.exit(setTimeLimit())
  tryCatch(
    withCallingHandlers(list(status = "ok", value = allowInterrupts(fun())),
      warning = function(w) invokeRestart("muffleWarning")),
    interrupt = function(e) list(status = "budget"),
    error = function(e) {
      msg <- tryCatch(as.character(e$message)[[1L]], error = function(e2) "")
      if (identical(msg, "reached elapsed time limit")) {
        list(status = "budget")
      } else {
        list(status = "error", class = tryCatch(class(e)[[1L]], error = function(e2) "error"))
      }
    })
}

# At most MAX_REPR_CHARS characters of valid UTF-8, a cut text ending with "...".
short_text <- function(s) {
  s <- bound_text(s, MAX_REPR_CHARS * 4L)
  if (nchar(s, type = "chars", allowNA = TRUE) > MAX_REPR_CHARS) {
    s <- paste0(substr(s, 1L, MAX_REPR_CHARS - 3L), "...")
  }
  s
}

# The JSON object of variable `nm` (a name of .GlobalEnv).
inspect_one <- function(nm, st) {
  fields <- list(name = json_str(nm))
  done <- function(repr) {
    fields$repr <- json_str(short_text(repr))
    json_obj(fields)
  }
  if (st$deadline <= 0) {
    fields$type <- json_str("?")
    return(done("<repr skipped: time budget used up>"))
  }
  if (bindingIsActive(nm, .GlobalEnv)) {
    fields$type <- json_str("active binding")
    return(done("<active binding: not read>"))
  }
  got <- inspect_call(st, function() get(nm, envir = .GlobalEnv, inherits = FALSE))
  if (identical(got$status, "budget")) st$deadline <- 0
  if (!identical(got$status, "ok")) {
    fields$type <- json_str("?")
    return(done(if (identical(got$status, "budget")) "<repr timed out>" else
      sprintf("<repr failed: %s>", got$class)))
  }
  x <- got$value
  cls <- tryCatch(class(x)[[1L]], error = function(e) "?")
  fields$type <- json_str(bound_text(cls, MAX_VARIABLE_TYPE - 64L))
  # Generics are called from a frame parented to .GlobalEnv, as call_in_global does, so
  # that S3 dispatch finds the user's methods.
  in_global <- function(expr) eval(expr, list(x = x), .GlobalEnv)
  size <- inspect_call(st, function() as.numeric(utils::object.size(x)))
  if (identical(size$status, "ok") && is.numeric(size$value) && length(size$value) == 1L &&
    is.finite(size$value) && size$value >= 0) {
    fields$size_bytes <- json_int(size$value)
  }
  if (identical(size$status, "budget")) {
    st$deadline <- 0
    return(done("<repr timed out>"))
  }
  d <- inspect_call(st, function() in_global(quote(dim(x))))
  if (identical(d$status, "ok") && is.numeric(d$value) && length(d$value) >= 1L &&
    length(d$value) <= MAX_SHAPE_DIMS && all(is.finite(d$value) & d$value >= 0)) {
    fields$shape <- paste0("[", paste(json_int(d$value), collapse = ","), "]")
  }
  if (identical(d$status, "budget")) {
    st$deadline <- 0
    return(done("<repr timed out>"))
  }
  r <- inspect_call(st, function() {
    in_global(bquote(utils::capture.output(utils::str(x, max.level = 1L, list.len = 5L,
      vec.len = 2L, give.attr = FALSE, nchar.max = .(MAX_REPR_CHARS)))))
  })
  if (identical(r$status, "budget")) {
    st$deadline <- 0
    return(done("<repr timed out>"))
  }
  if (!identical(r$status, "ok") || !is.character(r$value)) {
    return(done(sprintf("<repr failed: %s>", if (is.null(r$class)) "str" else r$class)))
  }
  lines <- r$value
  if (length(lines) > 12L) lines <- lines[seq_len(12L)]
  done(sub("\\s+$", "", sub("^ +", "", paste(lines, collapse = "\n"))))
}

# The `inspected` reply line for an inspect request with options `opts`.
inspect_reply <- function(opts) {
  max_items <- opts[["max_items"]]
  if (!is.numeric(max_items)) max_items <- INSPECT_DEFAULT_ITEMS
  max_items <- max(1, min(max_items, INSPECT_MAX_ITEMS))
  budget <- opts[["timeout_ms"]]
  if (!is.numeric(budget)) budget <- 4000
  st <- new.env(parent = emptyenv())
  st$deadline <- proc.time()[["elapsed"]] + budget / 1000
  nms <- ls(.GlobalEnv, all.names = FALSE, sorted = TRUE)
  nms <- nms[nzchar(nms) & !startsWith(nms, "_")]
  truncated <- FALSE
  keep <- vapply(nms, function(n) nchar(bound_text(n, 4L * MAX_VARIABLE_NAME),
    type = "bytes") <= MAX_VARIABLE_NAME, TRUE)
  if (!all(keep)) truncated <- TRUE
  nms <- nms[keep]
  if (length(nms) > max_items) {
    nms <- nms[seq_len(max_items)]
    truncated <- TRUE
  }
  items <- character(0)
  size <- 128
  for (nm in nms) {
    item <- tryCatch(inspect_one(nm, st), error = function(e) NULL)
    if (is.null(item)) next
    n <- nchar(item, type = "bytes") + 1
    if (size + n > MAX_INSPECT_LINE) {
      truncated <- TRUE
      break
    }
    size <- size + n
    items[[length(items) + 1L]] <- item
  }
  json_obj(list(
    t = json_str("inspected"),
    nonce = if (!is.null(state$nonce)) json_str(state$nonce),
    variables = paste0("[", paste(items, collapse = ","), "]"),
    truncated = if (truncated) "true" else "false"
  ))
}

## ---- complete and help ------------------------------------------------------------
#
# `complete` and `help` requests (Varlink Complete and Help) are not cells: the code is the
# payload, the cursor a character position in it. Completion is R's own (the console's TAB
# completion in utils: .assignLinebuffer, .guessTokenFromLine, .completeToken,
# .retrieveCompletions) on the cursor's line; help is args() of the name at the cursor (or of
# the call the cursor is in) and its help page as text (tools::Rd2txt). The user's code they
# may reach (a `$` completion evaluates the object, .DollarNames methods) runs through
# inspect_call with the request's `timeout_ms`; one that fails or runs out answers empty.

MAX_MATCHES <- 500L
MAX_MATCH_BYTES <- 256L
HELP_TEXT_BYTES <- 64L * 1024L

# The payload as UTF-8 text ("" when it is not valid UTF-8 or holds a NUL).
query_code <- function(payload) {
  if (any(payload == as.raw(0L))) return("")
  code <- rawToChar(payload)
  Encoding(code) <- "UTF-8"
  if (!validUTF8(code)) return("")
  code
}

# The cursor of a request: opts$cursor clamped to the code's characters.
query_cursor <- function(code, opts) {
  n <- nchar(code, type = "chars")
  c <- opts[["cursor"]]
  if (!is.numeric(c)) return(n)
  max(0, min(c, n))
}

# The line holding character `cursor` of `code`: list(line, pos (characters into the line),
# before (characters of the code before the line)).
query_position <- function(code, cursor) {
  lines <- strsplit(code, "\n", fixed = TRUE)[[1L]]
  before <- 0
  pos <- cursor
  for (l in lines) {
    n <- nchar(l, type = "chars")
    if (pos <= n) return(list(line = l, pos = pos, before = before))
    pos <- pos - n - 1
    before <- before + n + 1
  }
  list(line = "", pos = 0, before = before)
}

query_budget <- function(opts) {
  budget <- opts[["timeout_ms"]]
  if (!is.numeric(budget)) budget <- 2000
  st <- new.env(parent = emptyenv())
  st$deadline <- proc.time()[["elapsed"]] + min(budget, 2000) / 1000
  st
}

# The `completions` reply line of a complete request.
complete_reply <- function(payload, opts) {
  code <- query_code(payload)
  cursor <- query_cursor(code, opts)
  p <- query_position(code, cursor)
  st <- query_budget(opts)
  r <- inspect_call(st, function() {
    utils:::.assignLinebuffer(p$line)
    utils:::.assignEnd(p$pos)
    utils:::.guessTokenFromLine()
    utils:::.completeToken()
    list(comps = utils:::.retrieveCompletions(), token = utils:::.CompletionEnv[["token"]])
  })
  comps <- character(0)
  token <- ""
  if (identical(r$status, "ok") && is.character(r$value$comps) &&
    is.character(r$value$token) && length(r$value$token) == 1L) {
    comps <- unique(r$value$comps[!is.na(r$value$comps)])
    token <- r$value$token
  }
  tlen <- nchar(token, type = "chars")
  if (is.na(tlen) || tlen > p$pos) tlen <- 0
  truncated <- FALSE
  ok <- validUTF8(comps) & nchar(comps, type = "bytes") <= MAX_MATCH_BYTES & nzchar(comps)
  if (!all(ok)) truncated <- TRUE
  comps <- comps[ok]
  if (length(comps) > MAX_MATCHES) {
    comps <- comps[seq_len(MAX_MATCHES)]
    truncated <- TRUE
  }
  json_obj(list(
    t = json_str("completions"),
    nonce = if (!is.null(state$nonce)) json_str(state$nonce),
    matches = paste0("[", paste(vapply(comps, json_str, ""), collapse = ","), "]"),
    cursor_start = json_int(cursor - tlen),
    cursor_end = json_int(cursor),
    truncated = if (truncated) "true" else "false"
  ))
}

# The name at the cursor (letters, digits, "." and "_", with a `pkg::` prefix), else the
# function of the call the cursor is in, else "".
help_name <- function(p) {
  chars <- strsplit(p$line, "", fixed = TRUE)[[1L]]
  word <- "[A-Za-z0-9._:]"
  i <- p$pos
  while (i >= 1L && grepl(word, chars[[i]])) i <- i - 1L
  j <- p$pos + 1L
  while (j <= length(chars) && grepl(word, chars[[j]])) j <- j + 1L
  name <- if (j - 1L > i) paste(chars[(i + 1L):(j - 1L)], collapse = "") else ""
  ok <- function(n) grepl("^([A-Za-z.][A-Za-z0-9._]*:::?)?[A-Za-z.][A-Za-z0-9._]*$", n)
  if (ok(name)) return(name)
  depth <- 0L
  k <- p$pos
  while (k >= 1L) {
    ch <- chars[[k]]
    if (ch == ")") depth <- depth + 1L
    if (ch == "(") {
      if (depth == 0L) {
        m <- regmatches(substr(p$line, 1L, k - 1L),
          regexpr("([A-Za-z.][A-Za-z0-9._]*:::?)?[A-Za-z.][A-Za-z0-9._]*\\s*$",
            substr(p$line, 1L, k - 1L)))
        return(if (length(m)) sub("\\s+$", "", m) else "")
      }
      depth <- depth - 1L
    }
    k <- k - 1L
  }
  ""
}

# The `help` reply line of a help request.
help_reply <- function(payload, opts) {
  code <- query_code(payload)
  p <- query_position(code, query_cursor(code, opts))
  detail <- opts[["detail"]]
  detail <- is.numeric(detail) && detail >= 1
  st <- query_budget(opts)
  name <- help_name(p)
  parts <- character(0)
  found <- FALSE
  if (nzchar(name)) {
    topic <- sub("^.*:::?", "", name)
    pkg <- if (grepl("::", name, fixed = TRUE)) sub(":::?.*$", "", name)
    obj <- inspect_call(st, function() {
      if (is.null(pkg)) get(topic, envir = .GlobalEnv) else getExportedValue(pkg, topic)
    })
    if (identical(obj$status, "ok")) {
      found <- TRUE
      x <- obj$value
      if (is.function(x)) {
        a <- inspect_call(st, function() deparse(args(x)))
        if (identical(a$status, "ok") && is.character(a$value)) {
          sig <- a$value[a$value != "NULL"]
          parts <- c(parts, paste0(name, sub("^function ", "", paste(sub("\\s+$", "", sig),
            collapse = " "))))
        }
      } else {
        cls <- tryCatch(class(x)[[1L]], error = function(e) "?")
        parts <- c(parts, paste0(name, ": ", cls))
      }
      if (detail && is.function(x)) {
        src <- inspect_call(st, function() deparse(x))
        if (identical(src$status, "ok") && is.character(src$value)) {
          parts <- c(parts, "", "Source:", bound_text(paste(src$value, collapse = "\n"),
            HELP_TEXT_BYTES %/% 2L))
        }
      }
    }
    h <- inspect_call(st, function() {
      files <- as.character(do.call(utils::help,
        if (is.null(pkg)) list(topic = topic) else list(topic = topic, package = pkg)))
      if (!length(files)) return(character(0))
      rd <- utils:::.getHelpFile(files[[1L]])
      utils::capture.output(tools::Rd2txt(rd, out = "",
        options = list(underline_titles = FALSE)))
    })
    if (identical(h$status, "ok") && is.character(h$value) && length(h$value)) {
      found <- TRUE
      parts <- c(parts, "", h$value)
    }
  }
  text <- if (found) paste(parts, collapse = "\n") else ""
  text <- bound_text(text, HELP_TEXT_BYTES)
  json_obj(list(
    t = json_str("help"),
    nonce = if (!is.null(state$nonce)) json_str(state$nonce),
    found = if (found) "true" else "false",
    data = json_obj(list(`text/plain` = json_str(text)))
  ))
}

## ---- packages: per-session installs from the operator's CRAN repository ---------------
#
# install.packages("pkg") in a cell (this function, attached in sandcell:guards ahead of
# utils) installs from the environment's local CRAN-style repository
# (SANDCELL_CRAN_REPOSITORY: src/contrib/PACKAGES and the tarballs it lists, a read-only path
# of the worker's view) into SANDCELL_PACKAGES_DIR/R, a directory of the session's own file
# system (counted against its disk budget, gone with the session), put first on .libPaths(),
# so library(pkg) works in the same session right away. R's own install.packages() runs
# `R CMD INSTALL` in a child process, which builds from source (running the package's code,
# often a compiler); here nothing is built and no program is started: only binary packages
# are accepted (tarballs of installed package directories, as `R CMD INSTALL --build` makes
# them: they carry <pkg>/Meta/package.rds and a `Built:` field), unpacked in-process with
# untar(tar = "internal") into a staging directory and moved in whole. A source package is
# refused; so is a binary built for another R major.minor, a tarball whose MD5 differs from
# the index's MD5sum field (where the index has one), and a member path that leaves the
# package's directory. Dependencies (Depends, Imports) missing from the library paths come
# from the repository too. Of several index rows for one package, the highest Version is taken.

install_error <- function(msg) {
  stop(structure(class = c("packageInstallError", "error", "condition"),
    list(message = msg, call = NULL)))
}

# Of the index rows `rows` (one package), the one with the highest Version (an index may list
# several versions of a package, in any order); a row whose Version does not parse loses to
# one that does, and among equals the later row wins.
newest_row <- function(index, rows) {
  if (length(rows) == 1L || !("Version" %in% colnames(index))) return(rows[length(rows)])
  v <- package_version(index[rows, "Version"], strict = FALSE)
  ok <- which(!is.na(v))
  if (length(ok) == 0L) return(rows[length(rows)])
  best <- ok[[1L]]
  for (i in ok[-1L]) if (v[[i]] >= v[[best]]) best <- i
  rows[best]
}

install_packages_session <- function(pkgs, lib, repos, dependencies = NA, ...) {
  repo <- Sys.getenv("SANDCELL_CRAN_REPOSITORY")
  pdir <- Sys.getenv("SANDCELL_PACKAGES_DIR")
  if (!nzchar(repo) || !nzchar(pdir)) {
    install_error(paste("this environment has no package repository: the operator can name",
      "one in sandcelld.toml (cran_repository = \"/path\" in its [environments.<name>] table)"))
  }
  if (!is.character(pkgs) || length(pkgs) == 0L || anyNA(pkgs)) {
    install_error("install.packages() takes package names, e.g. install.packages(\"pkg\")")
  }
  target <- file.path(pdir, "R")
  dir.create(target, recursive = TRUE, showWarnings = FALSE, mode = "0700")
  if (!(normalizePath(target) %in% normalizePath(.libPaths()))) .libPaths(c(target, .libPaths()))
  contrib <- file.path(repo, "src", "contrib")
  index <- read.dcf(file.path(contrib, "PACKAGES"))
  field <- function(row, name) if (name %in% colnames(index)) row[[name]] else NA_character_
  have <- rownames(utils::installed.packages(lib.loc = .libPaths(), fields = character(0)))
  queue <- pkgs
  done <- character(0)
  while (length(queue) > 0L) {
    p <- queue[[1L]]
    queue <- queue[-1L]
    if (p %in% done || p %in% have) next
    rows <- which(index[, "Package"] == p)
    if (length(rows) == 0L) {
      offered <- sort(unique(index[, "Package"]))
      install_error(sprintf("package %s is not in the repository (it offers: %s)", p,
        paste(utils::head(offered, 20L), collapse = ", ")))
    }
    row <- index[newest_row(index, rows), ]
    version <- field(row, "Version")
    file <- field(row, "File")
    if (is.na(file)) {
      cands <- list.files(contrib, pattern = paste0("^", gsub(".", "\\.", p, fixed = TRUE), "_",
        gsub(".", "\\.", version, fixed = TRUE), "(_R_[^/]*)?\\.tar\\.gz$"))
      if (length(cands) == 0L) install_error(sprintf("package %s %s: no tarball in the repository", p, version))
      file <- cands[[1L]]
    }
    if (basename(file) != file) install_error(sprintf("package %s: bad File field", p))
    path <- file.path(contrib, file)
    md5 <- field(row, "MD5sum")
    if (!is.na(md5) && !identical(unname(tools::md5sum(path)), md5)) {
      install_error(sprintf("package %s: %s does not match the index's MD5sum: refused", p, file))
    }
    members <- utils::untar(path, list = TRUE, tar = "internal")
    if (!(paste0(p, "/Meta/package.rds") %in% members)) {
      install_error(sprintf(paste("package %s: %s is a source package; sandcell installs binary",
        "packages only, because installing from source runs R CMD INSTALL (the package's code,",
        "often a compiler), which sandcell's installer does not run: ask the operator",
        "for a binary package (R CMD INSTALL --build)"), p, file))
    }
    if (any(!startsWith(members, paste0(p, "/")) | grepl("(^|/)\\.\\.(/|$)", members))) {
      install_error(sprintf("package %s: %s has a member outside %s/", p, file, p))
    }
    # Compiled code would install and then fail to load: the session's files are mounted
    # noexec, so the loader cannot map a library from them. Refused up front, saying so.
    so <- grep("\\.(so|dylib|dll)$", members, value = TRUE)
    if (length(so)) {
      install_error(sprintf(paste("package %s: %s holds compiled code (%s), which cannot be",
        "loaded from a session's files (they are mounted noexec); only packages without",
        "compiled code install"), p, file, substr(so[[1L]], 1L, 200L)))
    }
    # A link member could make a later member land outside the package (untar follows it).
    link <- tar_link_member(path)
    if (!is.null(link)) {
      install_error(sprintf("package %s: %s has a link member (%s): refused", p, file,
        substr(link, 1L, 200L)))
    }
    stage <- file.path(target, paste0(".staging-", Sys.getpid()))
    unlink(stage, recursive = TRUE)
    dir.create(stage, mode = "0700")
    tryCatch({
      if (utils::untar(path, exdir = stage, tar = "internal") != 0L) {
        install_error(sprintf("package %s: %s could not be unpacked", p, file))
      }
      desc <- read.dcf(file.path(stage, p, "DESCRIPTION"))
      built <- if ("Built" %in% colnames(desc)) desc[1L, "Built"] else ""
      want <- paste0("R ", R.version$major, ".", strsplit(R.version$minor, ".", fixed = TRUE)[[1L]][1L], ".")
      if (!startsWith(built, want)) {
        install_error(sprintf("package %s: built for %s, not for this %s", p,
          sub(";.*", "", built), sub("\\.$", "", want)))
      }
      deps <- c(if ("Depends" %in% colnames(desc)) desc[1L, "Depends"],
        if ("Imports" %in% colnames(desc)) desc[1L, "Imports"])
      deps <- trimws(sub("\\(.*", "", unlist(strsplit(as.character(deps), ","))))
      deps <- setdiff(deps[nzchar(deps) & deps != "R"], c(have, done))
      if (!file.rename(file.path(stage, p), file.path(target, p))) {
        install_error(sprintf("package %s: could not be moved into the session library", p))
      }
    }, finally = unlink(stage, recursive = TRUE))
    done <- c(done, p)
    have <- c(have, p)
    queue <- c(deps, queue)
  }
  invisible(done)
}

# The name of the first symbolic or hard link member of the (possibly gzip-compressed) tar
# archive at `path`, or NULL: reads the 512-byte headers (POSIX ustar: size in octal at
# offset 124, type flag at 156, '1' hard link, '2' symbolic link) and skips the data.
tar_link_member <- function(path) {
  con <- gzfile(path, "rb")
  on.exit(close(con))
  repeat {
    h <- readBin(con, "raw", n = 512L)
    if (length(h) < 512L || all(h == as.raw(0L))) return(NULL)
    type <- rawToChar(h[157L])
    name <- rawToChar(h[1L:100L][h[1L:100L] != as.raw(0L)])
    if (type %in% c("1", "2")) return(name)
    size_text <- gsub("[^0-7]", "", rawToChar(h[125L:136L][h[125L:136L] != as.raw(0L)]))
    size <- if (nzchar(size_text)) strtoi(size_text, 8L) else 0L
    if (is.na(size)) return(name) # too large for a package member: refused as suspect
    left <- ceiling(size / 512) * 512
    while (left > 0) {
      got <- length(readBin(con, "raw", n = min(left, 1048576)))
      if (got == 0L) return(NULL)
      left <- left - got
    }
  }
}

## ---- quit() ------------------------------------------------------------------------

# Ends the session from a cell: reports `exited`, then exits R.
quit_from_cell <- function(save = "default", status = 0, runLast = TRUE) {
  code <- suppressWarnings(as.integer(status))
  if (length(code) != 1L || is.na(code)) code <- 0L
  reset_io()
  if (!is.null(state$cell) && !state$done_sent) {
    tryCatch(send_done(state$cell, list(status = "exited", exit_code = code,
      warnings = state$warnings)), error = function(e) NULL)
  }
  base::quit(save = "no", status = code, runLast = isTRUE(runLast))
}

# base::quit() called directly by a cell: still report the end of the cell.
reg.finalizer(state, function(e) {
  if (!is.null(state$cell) && !state$done_sent) {
    tryCatch(send_done(state$cell, list(status = "exited", warnings = character(0))),
      error = function(e) NULL)
  }
}, onexit = TRUE)

## ---- the serve loop ----------------------------------------------------------------

serve <- function(ready = TRUE) {
  if (ready) send_ready()
  repeat {
    reset_io()
    req <- read_request()
    if (is.null(req) || identical(req$op, "exit")) break
    if (identical(req$op, "inspect")) {
      drain_interrupt()
      state$nonce <- req$opts$nonce
      send_line(inspect_reply(req$opts))
      state$nonce <- NULL
      next
    }
    if (identical(req$op, "complete") || identical(req$op, "help")) {
      drain_interrupt()
      state$nonce <- req$opts$nonce
      line <- tryCatch(
        if (identical(req$op, "complete")) complete_reply(req$payload, req$opts) else
          help_reply(req$payload, req$opts),
        error = function(e) NULL)
      if (is.null(line)) {
        line <- if (identical(req$op, "complete")) {
          c0 <- json_int(query_cursor(query_code(req$payload), req$opts))
          paste0("{\"t\":\"completions\",\"matches\":[],\"cursor_start\":", c0,
            ",\"cursor_end\":", c0, ",\"truncated\":false",
            if (!is.null(state$nonce)) paste0(",\"nonce\":", json_str(state$nonce)), "}")
        } else {
          paste0("{\"t\":\"help\",\"found\":false,\"data\":{\"text/plain\":\"\"}",
            if (!is.null(state$nonce)) paste0(",\"nonce\":", json_str(state$nonce)), "}")
        }
      }
      send_line(line)
      state$nonce <- NULL
      next
    }
    # The answer to a call the last cell gave up on, or a `displayed` it stopped waiting for.
    if (identical(req$op, "host_reply") || identical(req$op, "displayed")) next
    if (!identical(req$op, "exec")) protocol_fail(paste("unknown request", req$op))
    # The request is whole: a successor daemon learns from this line that it arrived.
    send_line(json_obj(list(t = json_str("started"), cell = req$cell,
      nonce = if (!is.null(req$opts$nonce)) json_str(req$opts$nonce))))
    drain_interrupt()
    state$cell <- req$cell
    state$nonce <- req$opts$nonce
    state$host_calls <- identical(req$opts$host_calls, 1)
    state$done_sent <- FALSE
    devices <- plot_device_begin(req$cell)
    r <- run_cell(req$cell, req$payload, req$opts)
    plot_device_end(devices)
    if (identical(req$opts$rich, 1)) tryCatch(send_plots(req$cell), error = function(e) NULL)
    reset_io()
    send_done(req$cell, r)
    state$cell <- NULL
  }
}

## ---- recovery from a jump to top level -------------------------------------------
#
# Some failures bypass every handler and make R jump straight to top level: a segfault R
# recognises as a C stack overflow (deparse() of a deeply nested call, for one), or a cell
# calling invokeRestart("abort"). A non-interactive R then halts, unless options(error) is
# set: then it goes on reading this file after the end marker, where each of the
# lines below re-enters the serve loop once through resume(). The abandoned cell is
# reported as an error; the variables are kept. When the re-entry lines are used up,
# give_up() reports and exits.

resume <- function() {
  if (!is.null(state$cell) && !state$done_sent) {
    tryCatch(send_done(state$cell, list(status = "error", error = list(type = "topLevelJump",
      message = paste("R abandoned the cell (a C stack overflow, or invokeRestart(\"abort\"));",
        "the session's variables are kept")), warnings = state$warnings)),
    error = function(e) NULL)
  }
  state$cell <- NULL
  setTimeLimit()
  suspendInterrupts(serve(ready = FALSE))
  base::quit(save = "no", status = 0L, runLast = FALSE)
}

give_up <- function() {
  if (!is.null(state$cell) && !state$done_sent) {
    tryCatch(send_done(state$cell, list(status = "error", error = list(type = "topLevelJump",
      message = "R abandoned the cell too many times; the worker ends"),
      warnings = character(0))), error = function(e) NULL)
  }
  base::quit(save = "no", status = 1L, runLast = FALSE)
}

guards <- attach(NULL, name = "sandcell:guards")
assign("quit", quit_from_cell, envir = guards)
assign("q", quit_from_cell, envir = guards)
assign("host_call", host_call, envir = guards)
assign("install.packages", install_packages_session, envir = guards) # see "packages" above
assign(".sandcell_resume", resume, envir = guards)
assign(".sandcell_give_up", give_up, envir = guards)
lockEnvironment(guards, bindings = TRUE)
options(error = function() invisible(NULL))

suspendInterrupts(serve())
base::quit(save = "no", status = 0L, runLast = FALSE)
## sandcell: end of worker
# Re-entry points for resume() (see "recovery" above): one is used per jump to top level.
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_resume", envir = as.environment("sandcell:guards"))()
get(".sandcell_give_up", envir = as.environment("sandcell:guards"))()
