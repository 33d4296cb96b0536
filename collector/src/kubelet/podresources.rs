//! The kubelet's PodResources API, v1: its messages and a client of its `List` method, gRPC over
//! the kubelet's Unix socket (`/var/lib/kubelet/pod-resources/kubelet.sock`).
//!
//! The messages are written by hand with prost's derive rather than generated, so that building
//! needs no `protoc`. They follow `k8s.io/kubelet/pkg/apis/podresources/v1/api.proto` as of
//! Kubernetes 1.36 (k8s.io/kubelet v0.36.3) plus the pod-level `cpu_ids` and `memory` of
//! `PodResources` that its master branch adds (fields 4 and 5; the 1.37 line): field names and
//! numbers exactly as there, so a kubelet of any version since 1.20 (when v1 appeared) is read
//! correctly, fields a kubelet does not send staying empty. Only the messages of `List` are here;
//! `Get` and `GetAllocatableResources` are not used.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::codegen::http::Uri;
use tonic::transport::{Channel, Endpoint};

/// The kubelet's default socket of the PodResources API.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";

/// The gRPC service's full name (`package v1; service PodResourcesLister`).
pub const SERVICE: &str = "v1.PodResourcesLister";

/// The path of the `List` method on the wire.
pub const LIST_PATH: &str = "/v1.PodResourcesLister/List";

/// The largest `List` answer read: a node with many pods answers with large messages, and
/// gRPC's default limit of 4 MiB is what dcgm-exporter had to raise too.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// `message ListPodResourcesRequest {}`: the request made to the PodResourcesLister service.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

/// `message ListPodResourcesResponse`: the response returned by `List`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    /// `repeated PodResources pod_resources = 1;`
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

/// `message PodResources`: the node resources assigned to a pod.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    /// `string name = 1;`
    #[prost(string, tag = "1")]
    pub name: String,
    /// `string namespace = 2;`
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// `repeated ContainerResources containers = 3;`
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
    /// `repeated int64 cpu_ids = 4;`: exclusive CPUs allocated at the pod level.
    #[prost(int64, repeated, tag = "4")]
    pub cpu_ids: Vec<i64>,
    /// `repeated ContainerMemory memory = 5;`: memory allocated at the pod level.
    #[prost(message, repeated, tag = "5")]
    pub memory: Vec<ContainerMemory>,
}

/// `message ContainerResources`: the resources assigned to a container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    /// `string name = 1;`
    #[prost(string, tag = "1")]
    pub name: String,
    /// `repeated ContainerDevices devices = 2;`
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<ContainerDevices>,
    /// `repeated int64 cpu_ids = 3;`
    #[prost(int64, repeated, tag = "3")]
    pub cpu_ids: Vec<i64>,
    /// `repeated ContainerMemory memory = 4;`
    #[prost(message, repeated, tag = "4")]
    pub memory: Vec<ContainerMemory>,
    /// `repeated DynamicResource dynamic_resources = 5;`
    #[prost(message, repeated, tag = "5")]
    pub dynamic_resources: Vec<DynamicResource>,
}

/// `message ContainerMemory`: memory and hugepages assigned to a pod or container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerMemory {
    /// `string memory_type = 1;`
    #[prost(string, tag = "1")]
    pub memory_type: String,
    /// `uint64 size = 2;`
    #[prost(uint64, tag = "2")]
    pub size: u64,
    /// `TopologyInfo topology = 3;`
    #[prost(message, optional, tag = "3")]
    pub topology: Option<TopologyInfo>,
}

/// `message ContainerDevices`: the devices of one resource assigned to a container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerDevices {
    /// `string resource_name = 1;`, e.g. `nvidia.com/gpu`.
    #[prost(string, tag = "1")]
    pub resource_name: String,
    /// `repeated string device_ids = 2;`: what the device plugin calls them.
    #[prost(string, repeated, tag = "2")]
    pub device_ids: Vec<String>,
    /// `TopologyInfo topology = 3;`
    #[prost(message, optional, tag = "3")]
    pub topology: Option<TopologyInfo>,
}

/// `message TopologyInfo`: the hardware topology of a resource.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TopologyInfo {
    /// `repeated NUMANode nodes = 1;`
    #[prost(message, repeated, tag = "1")]
    pub nodes: Vec<NumaNode>,
}

/// `message NUMANode`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NumaNode {
    /// `int64 ID = 1;`
    #[prost(int64, tag = "1")]
    pub id: i64,
}

/// `message DynamicResource`: devices assigned to a container through Dynamic Resource
/// Allocation. Field 1 (`class_name`) was removed in Kubernetes 1.31.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DynamicResource {
    /// `string claim_name = 2;`
    #[prost(string, tag = "2")]
    pub claim_name: String,
    /// `string claim_namespace = 3;`
    #[prost(string, tag = "3")]
    pub claim_namespace: String,
    /// `repeated ClaimResource claim_resources = 4;`
    #[prost(message, repeated, tag = "4")]
    pub claim_resources: Vec<ClaimResource>,
}

/// `message ClaimResource`: one device of a claim.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ClaimResource {
    /// `repeated CDIDevice cdi_devices = 1;`
    #[prost(message, repeated, tag = "1")]
    pub cdi_devices: Vec<CdiDevice>,
    /// `string driver_name = 2;`
    #[prost(string, tag = "2")]
    pub driver_name: String,
    /// `string pool_name = 3;`
    #[prost(string, tag = "3")]
    pub pool_name: String,
    /// `string device_name = 4;`
    #[prost(string, tag = "4")]
    pub device_name: String,
    /// `optional string share_id = 5;`
    #[prost(string, optional, tag = "5")]
    pub share_id: Option<String>,
}

/// `message CDIDevice`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CdiDevice {
    /// `string name = 1;`: the fully qualified CDI device name.
    #[prost(string, tag = "1")]
    pub name: String,
}

/// The kubelet's PodResources API could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// Nothing answers on the socket (absent, refused, not a socket).
    #[error("cannot connect to the kubelet's PodResources socket {socket}: {message}")]
    Connect {
        /// The socket.
        socket: PathBuf,
        /// Why, with its causes.
        message: String,
    },
    /// The kubelet answered `List` with a gRPC error.
    #[error("the kubelet's PodResources List failed ({code:?}): {message}")]
    Status {
        /// The gRPC status code.
        code: tonic::Code,
        /// The status message, with the transport's causes where there are some.
        message: String,
    },
    /// No answer within the timeout.
    #[error("the kubelet's PodResources socket {socket} did not answer within {timeout:?}")]
    Timeout {
        /// The socket.
        socket: PathBuf,
        /// How long the collector waited.
        timeout: Duration,
    },
}

/// A client of `v1.PodResourcesLister` on a kubelet's Unix socket. Each [`list`](Self::list)
/// opens its own connection: once per collector interval is cheap on a local socket, and a
/// kubelet restart then needs no reconnection logic.
#[derive(Debug, Clone)]
pub struct PodResourcesClient {
    socket: PathBuf,
    timeout: Duration,
}

impl PodResourcesClient {
    /// A client of the socket at `socket`; each call (connection included) gives up after
    /// `timeout`.
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        Self {
            socket: socket.into(),
            timeout,
        }
    }

    /// The socket this client calls.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Calls `List`: every pod of the node with the resources assigned to its containers.
    pub async fn list(&self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        match tokio::time::timeout(self.timeout, self.call_list()).await {
            Ok(answer) => answer,
            Err(_) => Err(PodResourcesError::Timeout {
                socket: self.socket.clone(),
                timeout: self.timeout,
            }),
        }
    }

    async fn call_list(&self) -> Result<ListPodResourcesResponse, PodResourcesError> {
        let channel = connect(&self.socket)
            .await
            .map_err(|e| PodResourcesError::Connect {
                socket: self.socket.clone(),
                message: chain(&e),
            })?;
        let mut grpc =
            tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        // What tonic-build's generated client does for a unary method.
        grpc.ready().await.map_err(|e| PodResourcesError::Status {
            code: tonic::Code::Unavailable,
            message: chain(&e),
        })?;
        let mut request = tonic::Request::new(ListPodResourcesRequest {});
        request
            .extensions_mut()
            .insert(tonic::GrpcMethod::new(SERVICE, "List"));
        let codec = tonic_prost::ProstCodec::<ListPodResourcesRequest, _>::default();
        grpc.unary(request, PathAndQuery::from_static(LIST_PATH), codec)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| PodResourcesError::Status {
                code: status.code(),
                message: status_message(&status),
            })
    }
}

/// A channel whose every connection is a new stream on the Unix socket `socket`. The URI is
/// required by the API and sent as `:authority` (`localhost`, as gRPC-Go does for Unix
/// sockets), but nothing is resolved from it.
async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
}

/// An error and its causes, `: `-separated (tonic's transport error says only "transport
/// error" by itself).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

fn status_message(status: &tonic::Status) -> String {
    use std::error::Error as _;
    match status.source() {
        Some(cause) if status.message().is_empty() => chain(cause),
        Some(cause) => format!("{}: {}", status.message(), chain(cause)),
        None => status.message().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    /// Bytes of a `ListPodResourcesResponse` as the kubelet's gogo-generated Go code writes
    /// them, built field by field from the proto's numbers (not through this module's types).
    fn kubelet_bytes() -> Vec<u8> {
        fn field(tag: u32, wire: u8, body: &[u8]) -> Vec<u8> {
            let mut out = vec![((tag << 3) as u8) | wire];
            if wire == 2 {
                // The length, as a varint.
                let mut len = body.len();
                while len >= 0x80 {
                    out.push((len as u8) | 0x80);
                    len >>= 7;
                }
                out.push(len as u8);
            }
            out.extend_from_slice(body);
            out
        }
        let string = |tag, s: &str| field(tag, 2, s.as_bytes());
        let numa = field(1, 2, &field(1, 0, &[1])); // TopologyInfo { nodes: [NUMANode { ID: 1 }] }
        let devices = [
            string(1, "nvidia.com/gpu"),
            string(2, "GPU-a"),
            string(2, "GPU-b"),
            field(3, 2, &numa),
        ]
        .concat();
        let claim = [
            field(1, 2, &string(1, "nvidia.com/gpu=gpu0")),
            string(2, "gpu.nvidia.com"),
            string(3, "node-1"),
            string(4, "gpu-0"),
        ]
        .concat();
        let dynamic = [string(2, "claim-1"), string(3, "ml"), field(4, 2, &claim)].concat();
        let container = [
            string(1, "trainer"),
            field(2, 2, &devices),
            field(3, 2, &[4]), // proto3 packs repeated numbers
            field(5, 2, &dynamic),
        ]
        .concat();
        let pod = [
            string(1, "train-0"),
            string(2, "ml"),
            field(3, 2, &container),
            field(4, 2, &[2]),
        ]
        .concat();
        field(1, 2, &pod)
    }

    #[test]
    fn messages_decode_what_the_kubelet_writes() {
        let answer = ListPodResourcesResponse::decode(kubelet_bytes().as_slice()).unwrap();
        let pod = &answer.pod_resources[0];
        assert_eq!(
            (pod.name.as_str(), pod.namespace.as_str()),
            ("train-0", "ml")
        );
        assert_eq!(pod.cpu_ids, [2]);
        let container = &pod.containers[0];
        assert_eq!(container.name, "trainer");
        assert_eq!(container.cpu_ids, [4]);
        assert_eq!(container.devices[0].resource_name, "nvidia.com/gpu");
        assert_eq!(container.devices[0].device_ids, ["GPU-a", "GPU-b"]);
        assert_eq!(
            container.devices[0].topology,
            Some(TopologyInfo {
                nodes: vec![NumaNode { id: 1 }]
            })
        );
        let dynamic = &container.dynamic_resources[0];
        assert_eq!(
            (
                dynamic.claim_name.as_str(),
                dynamic.claim_namespace.as_str()
            ),
            ("claim-1", "ml")
        );
        let claim = &dynamic.claim_resources[0];
        assert_eq!(claim.cdi_devices[0].name, "nvidia.com/gpu=gpu0");
        assert_eq!(
            (
                claim.driver_name.as_str(),
                claim.pool_name.as_str(),
                claim.device_name.as_str()
            ),
            ("gpu.nvidia.com", "node-1", "gpu-0")
        );
        assert_eq!(claim.share_id, None);
        assert_eq!(
            answer.encode_to_vec(),
            kubelet_bytes(),
            "and encode to the same bytes"
        );
    }

    #[test]
    fn an_error_names_its_causes() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        #[derive(Debug, thiserror::Error)]
        #[error("transport error")]
        struct Outer(#[source] std::io::Error);
        assert_eq!(
            chain(&Outer(io)),
            "transport error: No such file or directory"
        );
    }
}
