"""What a trained model does: benchmark tasks scored by likelihood (HellaSwag, during training and
from the command line) and sampled text."""
