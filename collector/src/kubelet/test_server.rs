//! A kubelet's side of the PodResources API for tests: `v1.PodResourcesLister` served by tonic
//! on a Unix socket in a temporary directory, with the same messages, answering `List` with a
//! fixture (or never, to stand for a stuck kubelet). Its service is written as tonic-build
//! generates a server. Used by the unit tests beside the client and, through `#[path]`, by the
//! collector's integration tests.

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tonic::codegen::{http, Body, BoxFuture, Service, StdError};

use super::podresources::{ListPodResourcesRequest, ListPodResourcesResponse, LIST_PATH, SERVICE};

/// How the kubelet answers `List`.
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    /// With this.
    Pods(ListPodResourcesResponse),
    /// Never.
    Hang,
}

#[derive(Debug)]
struct State {
    answer: Answer,
    calls: usize,
}

/// The `PodResourcesLister` service.
#[derive(Debug, Clone)]
struct Lister(Arc<Mutex<State>>);

impl Lister {
    async fn list(
        &self,
        _request: tonic::Request<ListPodResourcesRequest>,
    ) -> Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
        let answer = {
            let mut state = self.0.lock().unwrap();
            state.calls += 1;
            state.answer.clone()
        };
        match answer {
            Answer::Pods(pods) => Ok(tonic::Response::new(pods)),
            Answer::Hang => std::future::pending().await,
        }
    }
}

impl tonic::server::NamedService for Lister {
    const NAME: &'static str = SERVICE;
}

struct ListMethod(Lister);

impl tonic::server::UnaryService<ListPodResourcesRequest> for ListMethod {
    type Response = ListPodResourcesResponse;
    type Future = BoxFuture<tonic::Response<Self::Response>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<ListPodResourcesRequest>) -> Self::Future {
        let lister = self.0.clone();
        Box::pin(async move { lister.list(request).await })
    }
}

impl<B> Service<http::Request<B>> for Lister
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() == LIST_PATH {
            let method = ListMethod(self.clone());
            return Box::pin(async move {
                let codec = tonic_prost::ProstCodec::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.unary(method, request).await)
            });
        }
        Box::pin(async move {
            let mut response = http::Response::new(tonic::body::Body::default());
            let headers = response.headers_mut();
            headers.insert(
                tonic::Status::GRPC_STATUS,
                (tonic::Code::Unimplemented as i32).into(),
            );
            headers.insert(
                http::header::CONTENT_TYPE,
                tonic::metadata::GRPC_CONTENT_TYPE,
            );
            Ok(response)
        })
    }
}

/// A kubelet serving PodResources on `socket` until dropped.
pub(crate) struct TestKubelet {
    /// Its socket.
    pub(crate) socket: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl TestKubelet {
    /// Serves `answer` on a new socket.
    pub(crate) fn start(answer: Answer) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("kubelet.sock");
        let state = Arc::new(Mutex::new(State { answer, calls: 0 }));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = {
            let _entered = runtime.enter();
            tokio::net::UnixListener::bind(&socket).unwrap()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let lister = Lister(Arc::clone(&state));
        let thread = std::thread::spawn(move || {
            let incoming = futures::stream::unfold(listener, |listener| async move {
                let accepted = listener.accept().await.map(|(stream, _)| stream);
                Some((accepted, listener))
            });
            let server = tonic::transport::Server::builder()
                .add_service(lister)
                .serve_with_incoming(incoming);
            // Stopping drops the runtime, and with it every connection, a hanging call's too.
            runtime.block_on(async move {
                tokio::select! {
                    served = server => served.unwrap(),
                    _ = stopped => {}
                }
            });
        });
        Self {
            socket,
            state,
            stop: Some(stop),
            thread: Some(thread),
            _dir: dir,
        }
    }

    /// How many `List` calls it has had.
    pub(crate) fn calls(&self) -> usize {
        self.state.lock().unwrap().calls
    }

    /// Answers `answer` from now on.
    pub(crate) fn answer(&self, answer: Answer) {
        self.state.lock().unwrap().answer = answer;
    }
}

impl Drop for TestKubelet {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
