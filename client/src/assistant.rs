//! The client core behind every front end (the CLI, the terminal chat, the
//! page and the OpenAI-compatible API): a model's client part opened once
//! (tokenizer, chat template, head), the place its blocks run (this process,
//! or a swarm seen through one long-lived [`SwarmView`]), and
//! [`Conversation`]s whose chains outlive a turn, so that a follow-up sends
//! only the tokens that are new since the previous one.

use std::ops::ControlFlow;

use corolla_model::embeddings::{RowFetch, RowFormat};
use corolla_model::fingerprint::{block_hashes, default_model_name};
use corolla_model::quantized::QTensor;
use corolla_model::wire::wire_dtype;
use corolla_model::{BlockSpan, Checkpoint, ClientHead, DType, Device, LlamaConfig};
use corolla_shared::node::NodeHandle;
use corolla_shared::WireDType;

use crate::chain::{Recovery, RemoteChain};
use crate::chat::{ChatMessage, ChatTemplate};
use crate::conversation::Chain;
pub use crate::conversation::{Conversation, CONVERSATION_LENGTH};
use crate::draft_model::DraftModel;
use crate::error::ClientError;
use crate::generate::{
    generate_after, AnswerEvent, GenerateOutput, GenerateRequest, LocalHead, TokenHead,
};
use crate::identities::{Identities, MAX_IDENTITIES};
use crate::local::LocalChain;
use crate::route::Hop;
use crate::session_settings::SessionSettings;
use crate::swarm_view::SwarmView;
use crate::text::TextTokenizer;
use crate::tokens::common_prefix;

/// Where the decoder blocks run: in this process, or on a swarm. Answers
/// through [`Blocks::answer`] with any [`TokenHead`] (the page's lives in a
/// worker); an [`Assistant`] pairs it with its own client part.
pub struct Blocks {
    place: Place,
    /// Where the chain's output tensors are made (the head's device).
    device: Device,
}

enum Place {
    Local(Vec<BlockSpan>),
    Swarm {
        identities: Identities,
        /// Every session's settings but its length.
        sessions: Box<SessionSettings>,
    },
}

/// What a client holds of a model: tokenizer, chat template and head
/// (embeddings, final norm, LM head).
pub struct ClientPart {
    /// The model's name, from the checkpoint.
    pub model: String,
    pub tokenizer: TextTokenizer,
    pub template: ChatTemplate,
    pub head: ClientHead,
}

impl ClientPart {
    pub fn load(checkpoint: &Checkpoint, dtype: DType) -> Result<Self, ClientError> {
        let head = ClientHead::load(checkpoint, dtype, &Device::Cpu)?;
        Self::with_head(checkpoint, head)
    }

    /// A client part held in pieces, as a page holds a 70B-class one: the
    /// LM head downloaded on its own, embedding rows fetched as needed
    /// ([`ClientHead::load_split`]).
    pub fn load_split(
        checkpoint: &Checkpoint,
        dtype: DType,
        lm_head: QTensor,
        rows: RowFormat,
        source: Box<dyn RowFetch>,
    ) -> Result<Self, ClientError> {
        let head = ClientHead::load_split(checkpoint, dtype, &Device::Cpu, lm_head, rows, source)?;
        Self::with_head(checkpoint, head)
    }

    fn with_head(checkpoint: &Checkpoint, head: ClientHead) -> Result<Self, ClientError> {
        let tokenizer = TextTokenizer::for_checkpoint(checkpoint)?;
        let cfg = checkpoint.config();
        let template = ChatTemplate::new(
            checkpoint.chat_template()?.as_deref(),
            &tokenizer,
            cfg.bos_token_id,
            cfg.eos_token_ids.first().copied(),
        )?;
        Ok(ClientPart {
            model: default_model_name(checkpoint),
            tokenizer,
            template,
            head,
        })
    }
}

/// A model opened on the client side, and where its blocks run.
pub struct Assistant {
    part: ClientPart,
    blocks: Blocks,
    /// Proposes drafts instead of prompt lookup.
    draft: Option<DraftModel>,
}

/// One answer: the output, how many prompt positions came from the
/// conversation's caches, and through a swarm the route that finished it
/// and the failures it survived.
#[derive(Debug, Clone)]
pub struct Answer {
    pub output: GenerateOutput,
    pub reused_tokens: usize,
    pub route: Option<Vec<Hop>>,
    pub recoveries: Vec<Recovery>,
    /// Servers spot checks caught returning wrong activations (banned for
    /// this client; the answer went on with honest results).
    pub suspects: Vec<String>,
    /// Steps that went down the whole route by server-to-server push.
    pub pushed_steps: usize,
}

impl Assistant {
    /// Runs every block of `checkpoint` in this process, in `dtype`.
    pub fn local(checkpoint: &Checkpoint, dtype: DType) -> Result<Self, ClientError> {
        let layers = checkpoint.config().num_hidden_layers;
        let span = BlockSpan::load(checkpoint, 0, layers, dtype, &Device::Cpu)?;
        Ok(Assistant {
            part: ClientPart::load(checkpoint, dtype)?,
            blocks: Blocks {
                place: Place::Local(vec![span]),
                device: Device::Cpu,
            },
            draft: None,
        })
    }

    /// Runs the blocks on the swarm `node` is part of; servers must hold
    /// the blocks of `checkpoint` (their hashes are checked).
    pub fn swarm(
        checkpoint: &Checkpoint,
        dtype: DType,
        node: NodeHandle,
        mut sessions: SessionSettings,
    ) -> Result<Self, ClientError> {
        if sessions.expected_blocks.is_none() {
            let layers = checkpoint.config().num_hidden_layers;
            sessions.expected_blocks = block_hashes(checkpoint, 0, layers).ok();
        }
        Self::on_swarm(ClientPart::load(checkpoint, dtype)?, node, sessions)
    }

    /// Runs `part`'s blocks on the swarm `node` is part of. `sessions` says
    /// how (timeouts, retries, allowed servers, flow control); its model
    /// name defaults to the part's, and the layer count and dtype are
    /// filled in here.
    pub fn on_swarm(
        part: ClientPart,
        node: NodeHandle,
        mut sessions: SessionSettings,
    ) -> Result<Self, ClientError> {
        if sessions.model.is_empty() {
            sessions.model = part.model.clone();
        }
        let head = &part.head;
        let blocks = Blocks::swarm(node, sessions, head.config(), head.dtype(), head.device())?;
        Ok(Assistant {
            part,
            blocks,
            draft: None,
        })
    }

    /// Drafts of multi-token steps come from `model` (a small model with
    /// this one's tokenizer) instead of prompt lookup.
    pub fn with_draft_model(mut self, model: DraftModel) -> Result<Self, ClientError> {
        model.check_tokenizer(&self.part.tokenizer, self.part.head.config().vocab_size)?;
        self.draft = Some(model);
        Ok(self)
    }

    /// Speaks to the swarm also as the peers of `nodes`
    /// ([`Blocks::also_speaking_as`]).
    pub fn also_speaking_as(mut self, nodes: Vec<NodeHandle>) -> Result<Self, ClientError> {
        self.blocks = self.blocks.also_speaking_as(nodes)?;
        Ok(self)
    }

    /// The draft model, where there is one.
    pub fn draft_model(&self) -> Option<&DraftModel> {
        self.draft.as_ref()
    }

    /// Gives the client part back (to join another swarm, say).
    pub fn into_part(self) -> ClientPart {
        self.part
    }

    /// The model's name (in the DHT, for a swarm).
    pub fn model(&self) -> &str {
        self.blocks.swarm_model().unwrap_or(&self.part.model)
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.part.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.part.template
    }

    pub fn head(&self) -> &ClientHead {
        &self.part.head
    }

    pub fn dtype(&self) -> DType {
        self.part.head.dtype()
    }

    /// The swarm view, for a swarm.
    pub fn swarm_view(&self) -> Option<&SwarmView> {
        self.blocks.swarm_view()
    }

    /// See [`Blocks::forgive_busy`].
    pub fn forgive_busy(&self) {
        self.blocks.forgive_busy();
    }

    /// Token ids of a chat prompt for `messages`, ending where the
    /// assistant's answer begins.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ClientError> {
        let text = self.part.template.render(messages, true)?;
        self.part.tokenizer.encode_chat(&text)
    }

    /// The most positions (prompt and answer) one conversation can have:
    /// the model's, and through a swarm also the servers' (as far as the
    /// view knows them).
    pub fn max_positions(&self) -> usize {
        self.blocks
            .max_positions(self.part.head.config().max_position_embeddings)
    }

    /// Answers `request` through `conversation` (see [`Blocks::answer`]).
    pub async fn answer(
        &self,
        conversation: &mut Conversation,
        request: &GenerateRequest,
        on_event: impl FnMut(AnswerEvent) -> ControlFlow<()>,
    ) -> Result<Answer, ClientError> {
        let mut head = LocalHead::new(&self.part.head, &request.sampling)?;
        if let (Some(model), true) = (&self.draft, request.drafts > 0) {
            head = head.with_draft_model(model, request.max_length().max(1))?;
        }
        self.blocks
            .answer(&mut head, conversation, request, on_event)
            .await
    }
}

impl Blocks {
    /// The blocks of a model with `config` on the swarm `node` is part of,
    /// exchanging activations in `dtype`; `sessions.model` names the model
    /// in the DHT, and the layer count and wire dtype are filled in here.
    pub fn swarm(
        node: NodeHandle,
        mut sessions: SessionSettings,
        config: &LlamaConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ClientError> {
        if sessions.model.is_empty() {
            return Err(ClientError::BadRequest(
                "a swarm's sessions need the model's name".into(),
            ));
        }
        sessions.num_layers = config.num_hidden_layers;
        sessions.dtype = match sessions.wire_dtype {
            Some(wire) => wire,
            None => default_wire_dtype(dtype)?,
        };
        let view = SwarmView::new(node, &sessions);
        Ok(Blocks {
            place: Place::Swarm {
                identities: Identities::new(view),
                sessions: Box::new(sessions),
            },
            device: device.clone(),
        })
    }

    /// Speaks to the swarm also as the peers of `nodes` (each a node of its
    /// own, in the same swarm), so that more chains are open at once than
    /// servers grant one peer; see [`crate::identities`].
    pub fn also_speaking_as(self, nodes: Vec<NodeHandle>) -> Result<Self, ClientError> {
        let Blocks { place, device } = self;
        let Place::Swarm {
            identities,
            sessions,
        } = place
        else {
            return Err(ClientError::BadRequest(
                "identities are for blocks on a swarm".into(),
            ));
        };
        if identities.len() + nodes.len() > MAX_IDENTITIES {
            return Err(ClientError::BadRequest(format!(
                "at most {MAX_IDENTITIES} identities"
            )));
        }
        let more = nodes
            .into_iter()
            .map(|node| SwarmView::new(node, &sessions));
        let identities = identities.extended(more);
        Ok(Blocks {
            place: Place::Swarm {
                identities,
                sessions,
            },
            device,
        })
    }

    /// The model's name in the DHT, for a swarm.
    pub fn swarm_model(&self) -> Option<&str> {
        match &self.place {
            Place::Swarm { sessions, .. } => Some(&sessions.model),
            Place::Local(_) => None,
        }
    }

    /// The swarm view (the first identity's), for a swarm.
    pub fn swarm_view(&self) -> Option<&SwarmView> {
        match &self.place {
            Place::Swarm { identities, .. } => Some(identities.first()),
            Place::Local(_) => None,
        }
    }

    /// After servers refused as busy and this client gave up sessions:
    /// every identity may try them again at once.
    pub fn forgive_busy(&self) {
        if let Place::Swarm { identities, .. } = &self.place {
            identities.forgive_busy();
        }
    }

    /// The most positions one conversation can have: `model_max`, and
    /// through a swarm also the servers' (as far as the view knows them).
    pub fn max_positions(&self, model_max: usize) -> usize {
        match &self.place {
            Place::Local(_) => model_max,
            Place::Swarm {
                identities,
                sessions,
            } => identities
                .first()
                .max_session_length(sessions.num_layers, None)
                .map_or(model_max, |servers| servers.min(model_max)),
        }
    }

    /// Answers `request` through `conversation`: its open sessions keep the
    /// positions the prompt shares with what they hold, and only the rest is
    /// sent. `head` embeds and samples (fresh for this request); `on_event`
    /// sees each token as it is sampled (and withdrawals, see
    /// [`AnswerEvent`]) and may stop the answer. After a
    /// failure the conversation's chain is closed (the next answer opens a
    /// new one).
    pub async fn answer<H: TokenHead>(
        &self,
        head: &mut H,
        conversation: &mut Conversation,
        request: &GenerateRequest,
        on_event: impl FnMut(AnswerEvent) -> ControlFlow<()>,
    ) -> Result<Answer, ClientError> {
        request.sampling.validate()?;
        let prompt = &request.prompt_ids;
        if prompt.is_empty() {
            return Err(ClientError::EmptyPrompt);
        }
        let needed = request.max_length().max(1);
        let model_max = head.config().max_position_embeddings;
        let mut reused = common_prefix(&conversation.cached, prompt).min(prompt.len() - 1);
        let same_adapter = conversation.chain_adapter == conversation.adapter;
        let mut chain = match conversation.chain.take() {
            Some(chain) if chain.capacity() >= needed && same_adapter => chain,
            old => {
                if let Some(old) = old {
                    old.close().await;
                }
                reused = 0;
                let length = Length {
                    needed,
                    reserve: conversation.reserve,
                    model_max,
                };
                let adapter = conversation.adapter.clone();
                let chain = self.open_chain(length, prompt.len(), adapter).await?;
                conversation.chain_adapter = conversation.adapter.clone();
                chain
            }
        };
        conversation.cached.clear();
        let result = match &mut chain {
            Chain::Local(local) => generate_after(head, local, request, reused, on_event)
                .await
                .map(|out| (out, None, Vec::new(), Vec::new(), 0)),
            Chain::Remote { chain: remote, .. } => {
                remote.rewind(reused);
                let out = generate_after(head, remote.as_mut(), request, reused, on_event).await;
                let suspects = remote.take_suspects();
                let pushed_steps = remote.take_pushed_steps();
                out.map(|out| {
                    (
                        out,
                        Some(remote.route()),
                        remote.take_recoveries(),
                        suspects,
                        pushed_steps,
                    )
                })
            }
        };
        if let (Ok((.., suspects, _)), Place::Swarm { identities, .. }) = (&result, &self.place) {
            identities.share_suspects(suspects);
        }
        match result {
            Ok((output, route, recoveries, suspects, pushed_steps)) => {
                // The last token sampled was never fed back.
                let fed = output.generated_ids.len().saturating_sub(1);
                conversation.cached = prompt.clone();
                conversation
                    .cached
                    .extend_from_slice(&output.generated_ids[..fed]);
                conversation.chain = Some(chain);
                Ok(Answer {
                    output,
                    reused_tokens: reused,
                    route,
                    recoveries,
                    suspects,
                    pushed_steps,
                })
            }
            Err(e) => {
                chain.close().await;
                Err(e)
            }
        }
    }

    /// A chain with room for `length.needed` positions, and up to
    /// `length.reserve` when the model and the servers allow, whose first
    /// step prefills `prompt_tokens` (routing prefers servers holding shared
    /// prefixes for long prompts), through servers that run `adapter`.
    async fn open_chain(
        &self,
        length: Length,
        prompt_tokens: usize,
        adapter: Option<String>,
    ) -> Result<Chain, ClientError> {
        let Length {
            needed,
            reserve,
            model_max,
        } = length;
        match &self.place {
            Place::Local(_) if adapter.is_some() => Err(ClientError::BadRequest(
                "adapters run on the swarm's servers; a local model runs its base weights".into(),
            )),
            Place::Local(spans) => Ok(Chain::Local(LocalChain::new(
                spans,
                needed.max(reserve.min(model_max)),
            )?)),
            Place::Swarm {
                identities,
                sessions,
            } => {
                let (view, lease) = identities.least_busy();
                view.ensure_fresh().await;
                let length = match view.max_session_length(sessions.num_layers, adapter.as_deref())
                {
                    Some(max) if needed > max => {
                        return Err(ClientError::SessionTooLong { needed, max });
                    }
                    Some(max) => needed.max(reserve.min(max).min(model_max)),
                    // Nothing covers every block yet: the chain waits for servers.
                    None => needed,
                };
                let mut settings = SessionSettings::clone(sessions);
                settings.max_length = length;
                settings.prompt_tokens = prompt_tokens;
                if adapter.is_some() {
                    // The client's own blocks run the base weights: as a
                    // referee they would contradict every honest server.
                    settings.referee = None;
                }
                settings.adapter = adapter;
                let chain = RemoteChain::connect_via(view, settings, &self.device).await?;
                Ok(Chain::Remote {
                    chain: Box::new(chain),
                    _lease: lease,
                })
            }
        }
    }
}

/// The positions a new chain needs, may reserve, and the model allows.
struct Length {
    needed: usize,
    reserve: usize,
    model_max: usize,
}

/// What crosses the wire when the user did not say: the compute dtype,
/// the narrowest format that loses nothing. So f16 and bf16 computation
/// (GPU servers) send halves, and f32 computation sends f32: on the default
/// model f16 between f32 spans changed 2 of 12 greedy answers (its residual
/// stream has outliers that f16 rounds coarsely; BENCHMARKS.md), and a
/// swarm's answer must equal the local one. `--wire-dtype f16` halves the
/// bytes for those who accept that.
pub fn default_wire_dtype(compute: DType) -> Result<WireDType, ClientError> {
    Ok(wire_dtype(compute)?)
}
