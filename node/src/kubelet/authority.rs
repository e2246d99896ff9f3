//! The kubelet's registration client and our gRPC server disagree about `:authority`.
//!
//! The kubelet dials a plugin's registration socket with the socket's path as the gRPC target, so
//! grpc-go sends the path, percent-encoded, as the HTTP/2 `:authority` (`%2Fvar%2Flib%2F…`). The
//! HTTP/2 server under tonic (h2) rejects such an authority as malformed and resets the stream
//! (`PROTOCOL_ERROR`): the kubelet never learns of the plugin. (The DRA calls themselves use a
//! `unix:` target, whose authority is `localhost`.)
//!
//! [`LocalAuthority`] sits between the socket and the server and rewrites the value of every
//! `:authority` field in the client's header blocks to `localhost`, leaving all else as it was.
//! It reads the HPACK structure only (lengths and indices), so Huffman-coded values need no
//! decoding. A field added to the dynamic table is rewritten where it is added, so later
//! references to it resolve to `localhost` on our side too; our entries are never larger than
//! the client's, so whatever the client still references, we still hold.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE_LEN: usize = 24;
const FRAME_HEADER_LEN: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may have; what the server expects by default.
const MAX_FRAME: usize = 16_384;
/// The static table's index of `:authority` (RFC 7541, appendix A).
const AUTHORITY_INDEX: usize = 1;
const LOCALHOST: &[u8] = b"localhost";

/// A header block being gathered across a HEADERS frame and its CONTINUATIONs.
struct Block {
    stream: [u8; 4],
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// A connection whose client header blocks carry `localhost` as their `:authority`.
pub struct LocalAuthority<S> {
    inner: S,
    preface_left: usize,
    /// Bytes read from the client, not yet handled.
    input: Vec<u8>,
    /// Bytes ready for the server, from `ready_from` on.
    ready: Vec<u8>,
    ready_from: usize,
    block: Option<Block>,
    eof: bool,
}

impl<S> LocalAuthority<S> {
    pub fn new(inner: S) -> Self {
        LocalAuthority {
            inner,
            preface_left: PREFACE_LEN,
            input: Vec::new(),
            ready: Vec::new(),
            ready_from: 0,
            block: None,
            eof: false,
        }
    }

    /// Moves what can be handled from `input` to `ready`.
    fn process(&mut self) {
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.input.len());
            self.ready.extend(self.input.drain(..n));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return;
            }
        }
        while self.input.len() >= FRAME_HEADER_LEN {
            let length = u32::from_be_bytes([0, self.input[0], self.input[1], self.input[2]]);
            let total = FRAME_HEADER_LEN + length as usize;
            if self.input.len() < total {
                return;
            }
            let frame: Vec<u8> = self.input.drain(..total).collect();
            self.frame(&frame);
        }
    }

    fn frame(&mut self, frame: &[u8]) {
        let (kind, flags) = (frame[3], frame[4]);
        let stream = [frame[5], frame[6], frame[7], frame[8]];
        let payload = &frame[FRAME_HEADER_LEN..];
        match kind {
            HEADERS if self.block.is_none() => {
                let Some((priority, fragment)) = split_headers(flags, payload) else {
                    // Malformed: the server says so.
                    self.ready.extend_from_slice(frame);
                    return;
                };
                self.block = Some(Block {
                    stream,
                    flags,
                    priority,
                    fragment: fragment.to_vec(),
                });
            }
            CONTINUATION if self.block.as_ref().is_some_and(|b| b.stream == stream) => {
                if let Some(block) = &mut self.block {
                    block.fragment.extend_from_slice(payload);
                }
            }
            _ => {
                // Anything else, also a frame the protocol forbids in the middle of a header
                // block: flush the block as it came, then the frame; the server judges.
                if let Some(block) = self.block.take() {
                    self.emit(block, false);
                }
                self.ready.extend_from_slice(frame);
                return;
            }
        }
        if flags & END_HEADERS != 0
            && let Some(block) = self.block.take()
        {
            self.emit(block, true);
        }
    }

    /// Writes a header block as a HEADERS frame and as many CONTINUATIONs as it needs.
    fn emit(&mut self, block: Block, complete: bool) {
        let fragment = if complete {
            rewrite_authority(&block.fragment).unwrap_or(block.fragment)
        } else {
            block.fragment
        };
        let mut first = Vec::new();
        if let Some(p) = block.priority {
            first.extend_from_slice(&p);
        }
        let room = MAX_FRAME - first.len();
        let (head, rest) = fragment.split_at(room.min(fragment.len()));
        first.extend_from_slice(head);
        let chunks: Vec<&[u8]> = rest.chunks(MAX_FRAME).collect();
        let keep = block.flags & !(PADDED | END_HEADERS);
        let last = if complete { END_HEADERS } else { 0 };
        let flags = keep | if chunks.is_empty() { last } else { 0 };
        self.push_frame(HEADERS, flags, block.stream, &first);
        for (i, chunk) in chunks.iter().enumerate() {
            let flags = if i + 1 == chunks.len() { last } else { 0 };
            self.push_frame(CONTINUATION, flags, block.stream, chunk);
        }
    }

    fn push_frame(&mut self, kind: u8, flags: u8, stream: [u8; 4], payload: &[u8]) {
        let length = (payload.len() as u32).to_be_bytes();
        self.ready.extend_from_slice(&length[1..]);
        self.ready.extend_from_slice(&[kind, flags]);
        self.ready.extend_from_slice(&stream);
        self.ready.extend_from_slice(payload);
    }
}

/// A HEADERS payload's priority fields and header block fragment, without padding.
fn split_headers(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut body = payload;
    if flags & PADDED != 0 {
        let (&pad, rest) = body.split_first()?;
        body = rest.get(..rest.len().checked_sub(pad as usize)?)?;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        priority = Some(body.get(..5)?.try_into().ok()?);
        body = &body[5..];
    }
    Some((priority, body))
}

/// An HPACK integer with an `n`-bit prefix at `at` (RFC 7541, 5.1): its value and the index
/// after it.
fn integer(block: &[u8], at: usize, n: u32) -> Option<(usize, usize)> {
    let mask = (1usize << n) - 1;
    let mut value = (*block.get(at)? as usize) & mask;
    let mut i = at + 1;
    if value < mask {
        return Some((value, i));
    }
    let mut shift = 0;
    loop {
        let b = *block.get(i)?;
        i += 1;
        value = value.checked_add(((b & 0x7f) as usize).checked_shl(shift)?)?;
        shift += 7;
        if b & 0x80 == 0 {
            return Some((value, i));
        }
        if shift > 28 {
            return None;
        }
    }
}

/// The index just past an HPACK string literal starting at `at`.
fn skip_string(block: &[u8], at: usize) -> Option<usize> {
    let (length, from) = integer(block, at, 7)?;
    let end = from.checked_add(length)?;
    (end <= block.len()).then_some(end)
}

/// The header block with each literal `:authority` value replaced by `localhost`; `None` when
/// it does not parse (it is then passed on as it came, for the server to refuse).
fn rewrite_authority(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(block.len());
    let mut i = 0;
    while i < block.len() {
        let b = block[i];
        let prefix_bits = if b & 0x80 != 0 {
            // Indexed field: nothing literal.
            let (_, next) = integer(block, i, 7)?;
            out.extend_from_slice(&block[i..next]);
            i = next;
            continue;
        } else if b & 0xc0 == 0x40 {
            6 // literal, with incremental indexing
        } else if b & 0xe0 == 0x20 {
            let (_, next) = integer(block, i, 5)?; // dynamic table size update
            out.extend_from_slice(&block[i..next]);
            i = next;
            continue;
        } else {
            4 // literal, without indexing or never indexed
        };
        let (name, mut next) = integer(block, i, prefix_bits)?;
        if name == 0 {
            next = skip_string(block, next)?;
        }
        let value_end = skip_string(block, next)?;
        if name == AUTHORITY_INDEX {
            // The representation byte(s) as they were (same kind, same name), a new value.
            out.extend_from_slice(&block[i..next]);
            out.push(LOCALHOST.len() as u8);
            out.extend_from_slice(LOCALHOST);
        } else {
            out.extend_from_slice(&block[i..value_end]);
        }
        i = value_end;
    }
    Some(out)
}

impl<S: AsyncRead + Unpin> AsyncRead for LocalAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready_from < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_from);
                buf.put_slice(&this.ready[this.ready_from..this.ready_from + n]);
                this.ready_from += n;
                if this.ready_from == this.ready.len() {
                    this.ready.clear();
                    this.ready_from = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What is left does not make a frame: pass it on, then end.
                if let Some(block) = this.block.take() {
                    this.emit(block, false);
                }
                this.ready.append(&mut this.input);
                if this.ready.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.eof = true;
            } else {
                this.input.extend_from_slice(read.filled());
                this.process();
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LocalAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for LocalAuthority<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// `:method GET`, `:scheme http`, `:path /`, then `:authority localhost` added to the
    /// dynamic table, as the rewrite gives it.
    const EXPECTED: &str = "82 86 84 41 09 6c6f63616c686f7374";

    #[test]
    fn an_authority_is_rewritten_plain_or_huffman_coded() {
        // RFC 7541, C.3.1 (plain) and C.4.1 (Huffman): :authority www.example.com.
        let plain = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        let huffman = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(rewrite_authority(&plain).unwrap(), hex(EXPECTED));
        assert_eq!(rewrite_authority(&huffman).unwrap(), hex(EXPECTED));
        // RFC 7541, C.3.2: the next request refers to the dynamic entry (be) and adds a
        // literal cache-control: untouched.
        let second = hex("8286 84be 5808 6e6f 2d63 6163 6865");
        assert_eq!(rewrite_authority(&second).unwrap(), second);
        // Never indexed, with a long (multi-byte length) percent-encoded path.
        let path = format!("%2F{}", "d%2F".repeat(60));
        let mut never = vec![0x11, 0x7f];
        never.extend_from_slice(&[(path.len() - 127) as u8]);
        never.extend_from_slice(path.as_bytes());
        assert_eq!(
            rewrite_authority(&never).unwrap(),
            hex("11 09 6c6f63616c686f7374")
        );
        // Truncated: no rewrite.
        assert_eq!(rewrite_authority(&hex("8286 8441 0f77")), None);
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[tokio::test]
    async fn a_connection_is_passed_on_with_its_authorities_rewritten() {
        let block = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let settings = frame(0x4, 0, 0, &hex("0003 0000 0064"));
        // Padded, with priority, split over a CONTINUATION.
        let mut headers_payload = vec![2u8];
        headers_payload.extend_from_slice(&hex("80000000 0f"));
        headers_payload.extend_from_slice(&block[..5]);
        headers_payload.extend_from_slice(&[0, 0]);
        let headers = frame(HEADERS, PADDED | PRIORITY | 0x1, 1, &headers_payload);
        let continuation = frame(CONTINUATION, END_HEADERS, 1, &block[5..]);
        let data = frame(0x0, 0x1, 1, b"body");
        let sent = [
            preface.clone(),
            settings.clone(),
            headers,
            continuation,
            data.clone(),
        ]
        .concat();

        let (mut client, server) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            // In small pieces, as a socket may deliver them.
            for piece in sent.chunks(7) {
                client.write_all(piece).await.unwrap();
            }
            client.shutdown().await.unwrap();
        });
        let mut received = Vec::new();
        LocalAuthority::new(server)
            .read_to_end(&mut received)
            .await
            .unwrap();
        writer.await.unwrap();

        let mut rewritten = hex("80000000 0f");
        rewritten.extend_from_slice(&hex(EXPECTED));
        let expected = [
            preface,
            settings,
            frame(HEADERS, PRIORITY | END_HEADERS | 0x1, 1, &rewritten),
            data,
        ]
        .concat();
        assert_eq!(received, expected);
    }
}
