//! A plain HTTP/1.1 GET (no TLS) for what the agent and the operator fetch from servers the
//! user names: a pool's dataset cache sources, an elastic set's Prometheus.

use std::time::Duration;

use http_body_util::BodyExt as _;

/// Why a GET failed.
#[derive(Debug, thiserror::Error)]
#[error("{url}: {reason}")]
pub struct HttpError {
    pub url: String,
    pub reason: String,
}

/// How long a GET may wait.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// For the connection.
    pub connect: Duration,
    /// For the answer, and between parts of its body.
    pub idle: Duration,
}

/// GETs `url` (`http://host[:port]/path?query`), handing the body to `sink` as it comes;
/// returns its length. Anything but a 2xx answer is an error naming the status.
pub async fn get(
    url: &str,
    timeouts: Timeouts,
    sink: &mut (dyn FnMut(&[u8]) -> std::io::Result<()> + Send),
) -> Result<u64, HttpError> {
    let fail = |reason: String| HttpError {
        url: url.to_string(),
        reason,
    };
    let uri: hyper::Uri = url.parse().map_err(|e| fail(format!("{e}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(fail("only http:// URLs are supported".into()));
    }
    let host = uri
        .host()
        .ok_or_else(|| fail("no host".into()))?
        .to_string();
    let port = uri.port_u16().unwrap_or(80);
    let idle = |what: &str| fail(format!("{what} took longer than {:?}", timeouts.idle));
    let tcp = tokio::time::timeout(
        timeouts.connect,
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    .map_err(|_| fail(format!("no connection within {:?}", timeouts.connect)))?
    .map_err(|e| fail(e.to_string()))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| fail(e.to_string()))?;
    tokio::spawn(connection);
    let request = hyper::Request::get(uri.clone())
        .header(hyper::header::HOST, host.as_str())
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .map_err(|e| fail(e.to_string()))?;
    let response = tokio::time::timeout(timeouts.idle, sender.send_request(request))
        .await
        .map_err(|_| idle("the answer"))?
        .map_err(|e| fail(e.to_string()))?;
    if !response.status().is_success() {
        return Err(fail(format!("the server answered {}", response.status())));
    }
    let mut body = response.into_body();
    let mut total = 0u64;
    while let Some(frame) = tokio::time::timeout(timeouts.idle, body.frame())
        .await
        .map_err(|_| idle("the next part of the body"))?
    {
        let frame = frame.map_err(|e| fail(e.to_string()))?;
        if let Some(data) = frame.data_ref() {
            sink(data).map_err(|e| fail(e.to_string()))?;
            total += data.len() as u64;
        }
    }
    Ok(total)
}
