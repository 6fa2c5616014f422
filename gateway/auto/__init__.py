"""`--mode auto`: acceptance estimates, step costs, the policy and its glue to the scheduler."""
